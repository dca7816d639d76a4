"""Stand-in for A1111's `modules.api` package (tests only)."""
