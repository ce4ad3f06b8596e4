"""Running `tokenmill serve` with a bad setting, for tests that it fails with one line before anything starts."""

from __future__ import annotations

import subprocess
import sys


def serve_error(*flags: str) -> str:
    """The one ``Error: ...`` line of ``tokenmill serve /nonexistent/model FLAGS``; asserts it failed with exactly
    one such line, no traceback, and before any model started loading."""
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "/nonexistent/model", *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr and "loading" not in result.stderr, result.stderr
    return errors[0]
