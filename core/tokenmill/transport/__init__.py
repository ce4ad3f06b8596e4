"""tokenmill.transport."""
