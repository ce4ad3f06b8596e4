"""``tokenmill bench engine-kills``: SIGKILL the engine of a loaded server again and again.

It starts ``tokenmill serve`` with the given config (``bench.local_server``) and
keeps ``concurrency`` streaming completions in flight: random token-id prompts of
``input_len`` tokens, ``output_len`` greedy tokens each, a client sending the
next as soon as one ends (and retrying a refused one every 0.25 s, as a client
would). Then ``kills`` times: once every stream is generating, it SIGKILLs
engine 0 and measures

- ``fail_s``: from the kill until the last stream in flight on it ended, each
  with an error event (the server's watchdog fails them);
- ``serve_s``: until a one-token probe request, sent every 0.1 s, got 200;
- ``health_s``: until ``/health`` answered 200 ``ok``;
- ``load_s``: how long the restarted engine took to load (the server's log line
  ``is up again after N s of loading``), so ``serve_s - load_s`` is what
  supervision adds (noticing the death, the 1 s wait, the handshake);

and checks the server's processes: one engine (a new one), nothing else. At the
end it reports the server's resident memory (RSS), open file descriptors and
listening ports after the warm-up (before the first kill) and after the last
restart; then it stops the server with SIGTERM and reports its exit status,
the processes still alive among all that ever ran under it, whether its port
and the engines' socket directory are gone. The targets: each
``fail_s`` under 5 s, each ``serve_s`` under the model's load time + 10 s, and
nothing left behind.

Needs psutil (``pip install 'tokenmill[bench]'``) to find the engine and the server's processes. Imports no
torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from tokenmill.config import EngineConfig
from tokenmill.engine_launcher import PROCESS_LABEL
from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench.local_server import LocalServer, start_local_server
from tokenmill_plugins.commands.bench.metrics import build_report
from tokenmill_plugins.commands.bench.workload import random_token_ids

logger = logging.getLogger(__name__)

_RETRY_S = 0.25  # a client's wait before it sends a refused request again
_PROBE_S = 0.1
_UP_AGAIN = re.compile(r"engine 0 at \S+ is up again after ([0-9.]+) s of loading \(restart (\d+)\)")


class EngineKillsError(TokenmillError):
    """The benchmark could not go on (the server did not recover, or psutil is missing)."""


def _psutil() -> Any:
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        raise EngineKillsError("tokenmill bench engine-kills needs psutil: pip install 'tokenmill[bench]'") from None
    return psutil


@dataclass
class _Client:
    """One client loop: sends a streaming request, reads it to its end, sends the next."""

    url: str
    model: str
    prompt: list[int]
    output_len: int
    is_generating: bool = False  # the current request has had a token
    request_number: int = 0
    last_error: str | None = None
    ends: dict[int, tuple[float, str | None]] = field(default_factory=dict)  # request number: when, error
    num_completed: int = 0
    num_failed: int = 0  # ended with an error event, mid-stream
    num_refused: int = 0  # answered with an HTTP error

    async def run(self, http: httpx.AsyncClient) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        while True:
            self.request_number += 1
            self.is_generating, self.last_error = False, None
            try:
                async with http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        self.num_refused += 1
                        self.last_error = f"HTTP {response.status_code}"
                    else:
                        await self._read(response)
            except httpx.HTTPError as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.num_failed += 1
            self.is_generating = False
            self.ends[self.request_number] = (time.monotonic(), self.last_error)
            if self.last_error is not None:
                await asyncio.sleep(_RETRY_S)

    async def _read(self, response: httpx.Response) -> None:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                self.last_error = event["error"].get("code") or "error"
                self.num_failed += 1
                return
            self.is_generating = True
        self.num_completed += 1


def _engine_processes(psutil: Any, server_pid: int) -> list[Any]:
    """The server's engine processes, engine 0 first (by address: ``engine-0.sock``, ...)."""
    engines = [child for child in psutil.Process(server_pid).children() if PROCESS_LABEL in child.cmdline()]
    return sorted(engines, key=lambda engine: engine.cmdline()[-1])


def _snapshot(psutil: Any, server_pid: int) -> dict[str, Any]:
    process = psutil.Process(server_pid)
    ports = sorted(
        c.laddr.port for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
    )  # fmt: skip
    return {
        "rss_mib": round(process.memory_info().rss / 2**20, 1),
        "num_fds": process.num_fds(),
        "num_threads": process.num_threads(),
        "listening_ports": ports,
        "num_children": len(process.children(recursive=True)),
    }


async def _wait_until(condition: Any, timeout: float, what: str) -> float:
    """Poll ``condition()`` every 20 ms; returns when it held (monotonic), raises after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise EngineKillsError(f"{what} did not happen within {timeout:.0f} s")
        await asyncio.sleep(0.02)
    return time.monotonic()


async def _kill_once(psutil: Any, server: LocalServer, clients: list[_Client], http: httpx.AsyncClient,
                     model: str, timeout: float) -> dict[str, Any]:  # fmt: skip
    """Kill engine 0 while every client is generating; measure until the server serves again."""
    server_pid = server.process.pid
    await _wait_until(lambda: all(client.is_generating for client in clients), timeout, "every stream generating")
    engine = _engine_processes(psutil, server_pid)[0]
    in_flight = {id(client): client.request_number for client in clients}
    killed = time.monotonic()
    os.kill(engine.pid, signal.SIGKILL)

    await _wait_until(lambda: all(in_flight[id(c)] in c.ends for c in clients), timeout, "the streams ending")
    ends = [client.ends[in_flight[id(client)]] for client in clients]
    fail_s = max(ended_at for ended_at, _ in ends) - killed
    num_failed = sum(1 for _, error in ends if error is not None)

    async def probe() -> float:
        body = {"model": model, "prompt": [1000], "max_tokens": 1, "temperature": 0}
        while True:
            try:
                if (await http.post(f"{server.url}/v1/completions", json=body)).status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            await asyncio.sleep(_PROBE_S)

    async def healthy() -> float:
        while True:
            response = await http.get(f"{server.url}/health")
            if response.status_code == 200 and response.json()["status"] == "ok":
                return time.monotonic()
            await asyncio.sleep(_PROBE_S)

    served, health = await asyncio.wait_for(asyncio.gather(probe(), healthy()), timeout)
    engines = _engine_processes(psutil, server_pid)
    return {
        "fail_s": round(fail_s, 3),
        "streams_failed": num_failed,
        "streams_in_flight": len(clients),
        "serve_s": round(served - killed, 2),
        "health_s": round(health - killed, 2),
        "old_engine_gone": not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE,
        "num_engines": len(engines),
        "new_engine": bool(engines) and engines[0].pid != engine.pid,
        "num_children": len(psutil.Process(server_pid).children(recursive=True)),
    }


async def _kill_loop(psutil: Any, server: LocalServer, model: str, *, kills: int, concurrency: int, input_len: int,
                     output_len: int, seed: int, timeout: float) -> dict[str, Any]:  # fmt: skip
    prompts = random_token_ids([input_len] * concurrency, seed=seed)
    clients = [_Client(server.url, model, prompt, output_len) for prompt in prompts]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as http:
        tasks = [asyncio.create_task(client.run(http)) for client in clients]
        try:
            await _wait_until(lambda: all(client.num_completed for client in clients), timeout, "a warm-up round")
            before = _snapshot(psutil, server.process.pid)
            results = []
            for number in range(1, kills + 1):
                result = await _kill_once(psutil, server, clients, http, model, timeout)
                logger.info("kill %d/%d: %s", number, kills, result)
                results.append(result)
            await _wait_until(lambda: all(client.is_generating for client in clients), timeout, "load after the kills")
            after = _snapshot(psutil, server.process.pid)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    totals = {
        "completed": sum(c.num_completed for c in clients),
        "failed_mid_stream": sum(c.num_failed for c in clients),
        "refused": sum(c.num_refused for c in clients),
    }
    return {"kills": results, "before": before, "after": after, "requests": totals}


def run_engine_kills(config: EngineConfig, *, kills: int, concurrency: int, input_len: int, output_len: int,
                     seed: int, server_timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """Start a server with ``config``, kill its engine ``kills`` times under load, stop it; the report."""
    psutil = _psutil()
    with tempfile.TemporaryDirectory(prefix="tokenmill-engine-kills-") as work_dir:
        started = time.monotonic()
        server = start_local_server(config, Path(work_dir), timeout_s=server_timeout_s)
        startup_s = time.monotonic() - started
        seen: dict[int, Any] = {}
        try:
            model = httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).json()["data"][0]["id"]
            socket_dirs = {os.path.dirname(e.cmdline()[-1].removeprefix("ipc://"))
                           for e in _engine_processes(psutil, server.process.pid)}  # fmt: skip
            loop_report = asyncio.run(
                _watching(psutil, server, seen, _kill_loop(
                    psutil, server, model, kills=kills, concurrency=concurrency, input_len=input_len,
                    output_len=output_len, seed=seed, timeout=server_timeout_s,
                ))
            )  # fmt: skip
        finally:
            stopped = time.monotonic()
            exit_status = server.stop()
            stop_s = time.monotonic() - stopped
        log = server.log_path.read_text(errors="replace")
    loads = {int(number): float(seconds) for seconds, number in _UP_AGAIN.findall(log)}
    for number, result in enumerate(loop_report["kills"], start=1):
        result["load_s"] = loads.get(number)
    left = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in seen.values() if _is_alive(psutil, p)]
    port = int(server.url.rsplit(":", 1)[1])
    results = {
        **loop_report,
        "startup_s": round(startup_s, 2),
        "exit_status": exit_status,
        "stop_s": round(stop_s, 2),
        "processes_seen": len(seen),
        "processes_left": left,
        "port_free": _is_port_free(port),
        "socket_dirs_left": sorted(d for d in socket_dirs if os.path.exists(d)),
    }
    parameters = {
        "model": config.model.model, "kills": kills, "concurrency": concurrency, "input_len": input_len,
        "output_len": output_len, "seed": seed, "config": msgspec.to_builtins(config),
    }  # fmt: skip
    return build_report("engine-kills", parameters, results)


async def _watching(psutil: Any, server: LocalServer, seen: dict[int, Any], work: Any) -> Any:
    """Run ``work`` while recording every process under the server every 50 ms (into ``seen``)."""

    async def watch() -> None:
        root = psutil.Process(server.process.pid)
        while True:
            for process in root.children(recursive=True):
                seen.setdefault(process.pid, process)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        return await work
    finally:
        watcher.cancel()


def _is_alive(psutil: Any, process: Any) -> bool:
    try:
        return bool(process.is_running()) and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_port_free(port: int) -> bool:
    """Whether a new server could listen on ``port``: SO_REUSEADDR, as uvicorn binds, so the closed
    connections' TIME_WAIT entries do not count, only a socket still listening."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def format_engine_kills(report: dict[str, Any]) -> str:
    """The report as a markdown table, one row per kill, then the summary."""
    results = report["results"]
    kills = results["kills"]
    parameters = report["parameters"]
    lines = [
        f"engine-kills: {parameters['kills']} SIGKILLs of engine 0 under {parameters['concurrency']} streams; "
        f"server start-up {results['startup_s']} s",
        "",
        "| kill | streams failed | fail s | serve again s | /health ok s | engine load s | new engine | children |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for number, kill in enumerate(kills, start=1):
        lines.append(
            f"| {number} | {kill['streams_failed']}/{kill['streams_in_flight']} | {kill['fail_s']} | {kill['serve_s']} "
            f"| {kill['health_s']} | {kill['load_s']} | {'yes' if kill['new_engine'] else 'NO'} "
            f"| {kill['num_children']} |"
        )
    if kills:
        fail = [k["fail_s"] for k in kills]
        serve = [k["serve_s"] for k in kills]
        extra = [k["serve_s"] - k["load_s"] for k in kills if k["load_s"] is not None]
        lines += [
            "",
            f"fail s: median {statistics.median(fail):.3f}, max {max(fail):.3f}; serve again s: median "
            f"{statistics.median(serve):.2f}, max {max(serve):.2f}"
            + (f"; serve again - engine load s: max {max(extra):.2f}" if extra else ""),
        ]
    before, after = results["before"], results["after"]
    lines += [
        f"server before / after the kills: RSS {before['rss_mib']} / {after['rss_mib']} MiB, open fds "
        f"{before['num_fds']} / {after['num_fds']}, threads {before['num_threads']} / {after['num_threads']}, "
        f"listening ports {before['listening_ports']} / {after['listening_ports']}, processes under it "
        f"{before['num_children']} / {after['num_children']}",
        f"requests: {results['requests']}",
        f"after SIGTERM: exit status {results['exit_status']} in {results['stop_s']} s; processes left "
        f"{len(results['processes_left'])} of {results['processes_seen']} seen; port free: {results['port_free']}; "
        f"socket directories left: {len(results['socket_dirs_left'])}",
    ]
    return "\n".join(lines)
