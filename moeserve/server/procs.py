"""Start ``moeserve`` server processes on loopback and stop them: what the demo and the PD
benchmark share (each process is the whole tree of one command: an API process and its ranks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

from moeserve.scheduler.ranks import free_port

START_TIMEOUT_S = 600


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: str | None
    command: tuple[str, ...] = ()  # the moeserve arguments it was started with, --port apart
    env: dict[str, str] | None = None  # variables added to its environment

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start(name: str, command: Sequence[str], log_dir: str | None = None, port: int | None = None,
          env: dict[str, str] | None = None) -> Proc:
    """``moeserve COMMAND... --port P`` in the background (``env`` added to this process's environment),
    waited for until ``/health`` answers 200."""
    port = port or free_port()
    log_path = os.path.join(log_dir, f"{name}.log") if log_dir else None
    out = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115 -- the child keeps it (a restart appends)
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.server.cli", *command, "--port", str(port)],
                            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None)
    started = Proc(name, proc, port, log_path, tuple(command), env)
    try:
        _wait_healthy(started)
    except BaseException:
        started.stop()
        raise
    return started


def _wait_healthy(p: Proc) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            where = f"; see {p.log_path}" if p.log_path else ""
            raise RuntimeError(f"{p.name} exited with code {p.proc.returncode} during start-up{where}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{p.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{p.name} was not healthy after {START_TIMEOUT_S} s")


def restart(p: Proc, log_dir: str | None = None) -> Proc:
    """The same command on the same port again (after ``p`` stopped or was killed)."""
    p.stop()
    return start(p.name, p.command, log_dir or (os.path.dirname(p.log_path) if p.log_path else None), p.port, p.env)


@contextlib.contextmanager
def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    """Stop every process on the way out, the last started first."""
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()


def pd_deployment(model_args: Sequence[str], prefill_args: Sequence[str], decode_args: Sequence[str],
                  backend: str, log_dir: str | None = None, num_prefill: int = 1, num_decode: int = 1,
                  router_args: Sequence[str] = (), decode_env: dict[str, str] | None = None) -> list[Proc]:
    """Prefill servers, decode servers and a router in front of them; the router last."""
    procs: list[Proc] = []
    try:
        pd = ["--disaggregation-transfer-backend", backend]
        prefill_urls = []
        for i in range(num_prefill):
            bootstrap = free_port()
            procs.append(start(f"prefill{i}", ["serve", *model_args, *pd, *prefill_args, "--disaggregation-mode",
                                               "prefill", "--disaggregation-bootstrap-port", str(bootstrap)], log_dir))
            prefill_urls += ["--prefill", procs[-1].url, str(bootstrap)]
        decode_urls = []
        for i in range(num_decode):
            procs.append(start(f"decode{i}", ["serve", *model_args, *pd, *decode_args, "--disaggregation-mode",
                                              "decode"], log_dir, env=decode_env))
            decode_urls += ["--decode", procs[-1].url]
        procs.append(start("router", ["router", "--pd-disaggregation", *prefill_urls, *decode_urls, *router_args],
                           log_dir))
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    return procs
