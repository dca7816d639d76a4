"""Stand-in for Forge's `modules_forge` package: its presence marks a Forge process (tests only)."""
