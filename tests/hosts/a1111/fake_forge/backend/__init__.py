"""Stand-in for Forge's `backend` package (tests only). See ../README.md."""
