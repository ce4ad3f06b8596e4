"""tokenmill.server."""
