"""Resident memory of a server's processes, by role, for ``tokenmill bench soak``.

A ``ProcessTree`` starts from the server's root process (the ``tokenmill serve``
front end) and samples the resident set size (RSS) of it and of every process
below it, each named by its role: ``frontend``, ``engine`` (a
``multiprocessing`` spawn child, or a process titled ``tokenmill-engine``),
``resource-tracker`` (``multiprocessing``'s helper), or the program's name.
Processes come and go between samples; each is keyed ``ROLE-PID``.

psutil is an optional dependency (``pip install 'tokenmill[bench]'``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)


class ProcessTreeError(TokenmillError):
    """The server's processes cannot be found or read; the message says what to pass."""


def _psutil() -> Any:
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        raise ProcessTreeError(
            "tokenmill bench soak samples memory with psutil: pip install 'tokenmill[bench]' (or psutil)"
        ) from None
    return psutil


def process_role(cmdline: Sequence[str], *, is_root: bool) -> str:
    """What a process of a ``tokenmill serve`` tree is, from its command line."""
    text = " ".join(cmdline)
    if "resource_tracker" in text:
        return "resource-tracker"
    if "tokenmill-engine" in text or "spawn_main" in text:
        return "engine"
    if is_root:
        return "frontend"
    if "compile_worker" in text:
        return "compile-worker"
    program = cmdline[0].rsplit("/", 1)[-1] if cmdline else ""
    return program or "child"


class ProcessTree:
    """The RSS of a root process and of all its descendants, sampled on demand.

    Called from the soak's sampling thread only (psutil objects are not shared).
    """

    def __init__(self, root_pid: int) -> None:
        psutil = _psutil()
        try:
            self._root = psutil.Process(root_pid)
        except psutil.Error as exc:
            raise ProcessTreeError(f"cannot read process {root_pid}: {exc}; check --server-pid") from None
        self._keys: dict[int, str] = {}

    @property
    def root_pid(self) -> int:
        return int(self._root.pid)

    def sample(self) -> dict[str, int]:
        """{``ROLE-PID``: RSS in bytes} of the root and every descendant alive now; empty once the root is gone."""
        psutil = _psutil()
        try:
            processes = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return {}
        rss: dict[str, int] = {}
        for process in processes:
            try:
                key = self._keys.get(process.pid)
                if key is None:
                    role = process_role(process.cmdline(), is_root=process.pid == self._root.pid)
                    key = self._keys[process.pid] = f"{role}-{process.pid}"
                rss[key] = int(process.memory_info().rss)
            except psutil.Error:  # exited between the listing and the read
                continue
        return rss


def find_listening_pid(base_url: str) -> int | None:
    """The pid of the local process listening on ``base_url``'s port, or None (not local, or not visible)."""
    psutil = _psutil()
    parts = urlsplit(base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.hostname not in ("127.0.0.1", "localhost", "0.0.0.0", "::1"):
        return None
    try:
        connections = psutil.net_connections(kind="inet")
    except psutil.Error as exc:
        logger.warning("cannot list sockets to find the server's process (%s); pass --server-pid", exc)
        return None
    for connection in connections:
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
            return int(connection.pid) if connection.pid else None
    return None
