"""Stand-in for A1111's `modules` package (tests only). See ../README.md."""
