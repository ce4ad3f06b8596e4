"""The base of every error a user (or a plugin author) can fix.

Importing this module is cheap and never imports torch, so the CLI and the
front end can catch every such error without loading the engine.
"""

from __future__ import annotations


class TokenmillError(Exception):
    """A mistake outside tokenmill's code: a bad setting, file or plugin.

    The message is one line that says what is wrong and what to change; the
    ``tokenmill`` command prints it without a traceback.
    """
