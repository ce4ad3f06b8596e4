"""tokenmill.bench."""
