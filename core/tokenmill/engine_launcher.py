"""Local engine processes, from the front end's side: started, stopped, and started again after they die.

An engine the front end runs on its own host is a ``LocalEngineProcess``: a
fresh interpreter running ``tokenmill.engine_process.run_engine_process`` (the
engine's side, which this module never imports), in a process group of its
own, which the front end stops (SIGTERM, then SIGKILL for the whole group) and
starts again after it dies (``tokenmill.engine_client`` supervises it).

Imports neither torch nor the engine: the front end imports it to start
engine processes, and the engine process imports only ``PROCESS_LABEL`` from
it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.transport.base import TransportSecurity

#: In the command line of every engine process a front end starts (``ps``, ``pgrep -f``).
PROCESS_LABEL = "tokenmill-engine"

# What a LocalEngineProcess runs: the front end's sys.path, then the engine, with the config read from stdin. Its
# arguments only label it in `ps`: `python -c ... tokenmill-engine ipc:///tmp/tokenmill-.../engine-0.sock`.
_BOOTSTRAP = (
    "import json, sys; payload = json.load(sys.stdin); sys.path[:] = payload['sys_path']; "
    "from tokenmill.engine_process import run_engine_process; "
    "run_engine_process(payload['config'], payload['address'], watch_parent=True)"
)


class LocalEngineProcess:
    """An engine process the front end runs on its own host: started, stopped, and started again after it died.

    The engine runs ``tokenmill.engine_process.run_engine_process`` in a fresh interpreter (``sys.executable``
    with the front end's ``sys.path``; the config arrives as JSON on its stdin), in a process group of its own:
    a Ctrl-C at the terminal reaches only the front end, which drains before it stops the engines, and killing
    the group also kills whatever the engine started (compiler workers), even when the engine itself was
    killed first. Used in the front end's event loop; nothing here blocks for long.

    :param config_data: the engine's ``EngineConfig`` as builtins (``EngineConfig.to_dict()``).
    :param address: the ``ipc://`` address the engine serves; its socket file is removed when it stops.
    """

    def __init__(self, config_data: dict[str, Any], address: str) -> None:
        self.config_data = config_data
        self.address = address
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def exitcode(self) -> int | None:
        """The exit status once it has exited (``-N``: killed by signal N), else None."""
        return self._popen.returncode if self._popen is not None else None

    @property
    def exit_reason(self) -> str:
        """How it ended, as the end of a sentence (``was killed by SIGKILL``)."""
        return describe_exit(self.exitcode)

    async def locate(self, timeout: float) -> tuple[str, TransportSecurity | None]:
        """Where the engine serves (its fixed ipc:// address), and no keys of its own."""
        return self.address, None

    async def restart(self) -> None:
        """Start it again once it died: reap it and whatever it started, then start a fresh one."""
        await self.stop(timeout=0)
        self.start()

    def start(self) -> None:
        """Start the engine: the first time, or again once the previous one was stopped."""
        assert self._popen is None or self._popen.returncode is not None, "the previous engine still runs"
        socket_path = _ipc_path(self.address)
        if socket_path is not None:
            os.makedirs(os.path.dirname(socket_path), exist_ok=True)
        payload = json.dumps({"sys_path": sys.path, "config": self.config_data, "address": self.address})
        command = [sys.executable, "-c", _BOOTSTRAP, PROCESS_LABEL, self.address]
        popen = subprocess.Popen(command, stdin=subprocess.PIPE, process_group=0)
        self._popen = popen
        assert popen.stdin is not None
        try:
            popen.stdin.write(payload.encode())
            popen.stdin.close()
        except OSError:  # it died at once; is_alive says so
            pass

    def is_alive(self) -> bool:
        """Whether the engine runs. Once it has exited, what is left of its process group is killed and the
        engine reaped (its ``exitcode`` set)."""
        popen = self._popen
        if popen is None or popen.returncode is not None:
            return False
        try:
            # WNOWAIT leaves an exited engine unreaped, so its pid, the group's id, cannot be reused meanwhile.
            has_exited = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped elsewhere
            has_exited = True
        if not has_exited:
            return True
        self._kill_group()
        popen.wait()
        return False

    def kill(self) -> None:
        """SIGKILL the engine and every process in its group, now; ``is_alive`` or ``stop`` reap it."""
        if self._popen is not None and self._popen.returncode is None:
            self._kill_group()

    async def stop(self, timeout: float) -> None:
        """SIGTERM; up to ``timeout`` s to exit (it finishes its step and flushes its KV tiers); then SIGKILL
        for its whole group. Returns once the engine is reaped; removes its socket file and, once empty, the
        socket's directory."""
        popen = self._popen
        if popen is not None and self.is_alive():
            try:
                popen.terminate()
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while self.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if popen.returncode is None:
                self._kill_group()
                while self.is_alive():
                    await asyncio.sleep(0.01)
        socket_path = _ipc_path(self.address)
        if socket_path is not None:
            for remove, path in ((os.unlink, socket_path), (os.rmdir, os.path.dirname(socket_path))):
                try:
                    remove(path)
                except OSError:
                    pass

    def _kill_group(self) -> None:
        assert self._popen is not None
        try:
            os.killpg(self._popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, as the end of a sentence: ``exited with code 1``, ``was killed by SIGKILL``."""
    if exitcode is None:
        return "exited"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _ipc_path(address: str) -> str | None:
    return address.removeprefix("ipc://") if address.startswith("ipc://") else None
