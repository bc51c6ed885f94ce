"""Start ``moeserve`` server processes on loopback and stop them: what the demo and the PD
benchmark share (each process is the whole tree of one command: an API process and its ranks)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

START_TIMEOUT_S = 600
BOOTSTRAP_FLAG = "--disaggregation-bootstrap-port"


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: str | None
    command: tuple[str, ...] = ()  # the moeserve arguments it was started with, --port apart
    env: dict[str, str] | None = None  # variables added to its environment
    bootstrap_port: int | None = None  # a prefill server's bootstrap server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 60) -> int:
        return stop_all([self], timeout_s)[0]


def start(name: str, command: Sequence[str], log_dir: str | None = None, port: int = 0,
          env: dict[str, str] | None = None) -> Proc:
    """``moeserve COMMAND... --port P`` in the background (``env`` added to this process's environment),
    waited for until ``/health`` answers 200. With ``port`` 0 the server binds a free port itself and
    reports it (``--port-file``), as it does a bootstrap port of 0: no port is picked here and handed
    over later, when another process could have taken it."""
    return start_all([launch(name, command, log_dir, port, env)])[0]


@dataclass
class Launch:
    """A server process started and not yet known to be healthy (``start_all`` waits for it)."""

    proc: Proc
    port_dir: tempfile.TemporaryDirectory

    @property
    def port_file(self) -> str:
        return os.path.join(self.port_dir.name, "ports.json")


def launch(name: str, command: Sequence[str], log_dir: str | None = None, port: int = 0,
           env: dict[str, str] | None = None) -> Launch:
    """Start ``moeserve COMMAND...``, without waiting for it (``start``)."""
    log_path = os.path.join(log_dir, f"{name}.log") if log_dir else None
    out = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115 -- the child keeps it (a restart appends)
    port_dir = tempfile.TemporaryDirectory(prefix="moeserve-ports-")
    port_file = os.path.join(port_dir.name, "ports.json")
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.server.cli", *command, "--port", str(port),
                             "--port-file", port_file],
                            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None)
    return Launch(Proc(name, proc, port, log_path, tuple(command), env), port_dir)


def start_all(launches: list[Launch]) -> list[Proc]:
    """Wait until every launched server listens and answers ``/health`` (they start side by side);
    if one fails, stop them all and raise."""
    try:
        for item in launches:
            ports = _wait_ports(item.proc, item.port_file)
            item.proc.port, item.proc.bootstrap_port = ports["port"], ports.get("bootstrap_port")
        for item in launches:
            _wait_healthy(item.proc)
    except BaseException:
        for item in launches:
            item.proc.stop()
        raise
    finally:
        for item in launches:
            item.port_dir.cleanup()
    return [item.proc for item in launches]


def _wait_ports(p: Proc, port_file: str) -> dict[str, int]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not os.path.exists(port_file):
        _check_alive(p)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{p.name} did not listen within {START_TIMEOUT_S} s")
        time.sleep(0.05)
    with open(port_file) as f:
        return json.load(f)


def _check_alive(p: Proc) -> None:
    if p.proc.poll() is not None:
        where = f"; see {p.log_path}" if p.log_path else ""
        raise RuntimeError(f"{p.name} exited with code {p.proc.returncode} during start-up{where}")


def _wait_healthy(p: Proc) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        _check_alive(p)
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{p.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{p.name} was not healthy after {START_TIMEOUT_S} s")


def restart(p: Proc, log_dir: str | None = None) -> Proc:
    """The same command on the same ports again (after ``p`` stopped or was killed)."""
    p.stop()
    command = list(p.command)
    if p.bootstrap_port is not None:
        command[command.index(BOOTSTRAP_FLAG) + 1] = str(p.bootstrap_port)
    return start(p.name, command, log_dir or (os.path.dirname(p.log_path) if p.log_path else None), p.port, p.env)


def stop_all(procs: Sequence[Proc], timeout_s: float = 60) -> list[int]:
    """SIGTERM to every process still running, all at once (each shuts down in seconds: one after
    another, a deployment's took the sum), then each waited for within ``timeout_s`` of the signal
    and killed past it. Their exit codes, in order."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.proc.wait(max(deadline - time.monotonic(), 0)))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            codes.append(p.proc.wait())
    return codes


@contextlib.contextmanager
def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    """Stop every process on the way out."""
    try:
        yield procs
    finally:
        stop_all(procs)


def pd_deployment(model_args: Sequence[str], prefill_args: Sequence[str], decode_args: Sequence[str],
                  backend: str, log_dir: str | None = None, num_prefill: int = 1, num_decode: int = 1,
                  router_args: Sequence[str] = (), decode_env: dict[str, str] | None = None,
                  prefill_each: Sequence[Sequence[str]] = (), decode_each: Sequence[Sequence[str]] = ()) -> list[Proc]:
    """Prefill servers, decode servers (started side by side) and a router in front of them; the router
    last. ``prefill_each[i]`` / ``decode_each[i]`` are flags of server ``i`` alone."""
    pd = ["--disaggregation-transfer-backend", backend]
    launches = [launch(f"prefill{i}", ["serve", *model_args, *pd, *prefill_args, *_nth(prefill_each, i),
                                       "--disaggregation-mode", "prefill", BOOTSTRAP_FLAG, "0"], log_dir)
                for i in range(num_prefill)]
    launches += [launch(f"decode{i}", ["serve", *model_args, *pd, *decode_args, *_nth(decode_each, i),
                                       "--disaggregation-mode", "decode"], log_dir, env=decode_env)
                 for i in range(num_decode)]
    servers = start_all(launches)
    urls = [arg for p in servers[:num_prefill] for arg in ("--prefill", p.url, str(p.bootstrap_port))]
    urls += [arg for p in servers[num_prefill:] for arg in ("--decode", p.url)]
    try:
        return [*servers, start("router", ["router", "--pd-disaggregation", *urls, *router_args], log_dir)]
    except BaseException:
        for p in reversed(servers):
            p.stop()
        raise


def _nth(per_server: Sequence[Sequence[str]], i: int) -> Sequence[str]:
    return per_server[i] if i < len(per_server) else ()
