"""The `kvtool` command line."""
