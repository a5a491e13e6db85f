"""The `agents` command line."""
