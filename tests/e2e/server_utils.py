"""Start and stop real ``moeserve serve`` processes on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

START_TIMEOUT_S = 120


def free_port_run(n: int, attempts: int = 64) -> int:
    """A port ``p`` such that ``p .. p+n-1`` can all be bound now (a multi-node launch takes a run).
    Drawn below the kernel's ephemeral range, so that no socket bound to port 0 meanwhile (by any
    process) can be handed one of them before the launch binds them."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(max(low - 12000, 1024), low - n)
        if base <= 30000 < base + n:  # moeserve serve's default port
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no run of {n} free ports in {attempts} tries")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_pids(pid: int) -> list[int]:
    """The engine rank processes below ``pid`` (they name themselves ``moeserve-rankN``)."""
    found = []
    for child in descendants(pid):
        with contextlib.suppress(OSError), open(f"/proc/{child}/comm") as f:
            if f.read().startswith("moeserve-rank"):
                found.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: str
    bootstrap_port: int | None = None  # a prefill server's bootstrap server

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal the server and wait; on a timeout kill the whole tree and raise."""
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *tree]:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            raise


def start_server(args: list[str], log_path: str, port: int = 0) -> Server:
    """``moeserve serve ARGS`` on ``port`` (0: a port the server binds itself and reports back in its
    port file, so that no other process can take it in between), once ``/health`` answers 200."""
    port_file = f"{log_path}.ports.json"
    with contextlib.suppress(FileNotFoundError):
        os.remove(port_file)
    log = open(log_path, "w")  # noqa: SIM115 -- the child writes it
    cmd = [sys.executable, "-m", "moeserve.server.cli", "serve", "--port", str(port), "--port-file", port_file, *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        if server.port == 0 and os.path.exists(port_file):
            with open(port_file) as f:
                ports = json.load(f)
            server.port, server.bootstrap_port = ports["port"], ports.get("bootstrap_port")
        if server.port:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200:
                    return server
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s:\n{server.log()}")


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of a Prometheus metric whose labels include ``labels``."""
    total, found = 0.0, False
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
                found = True
    if not found:
        raise KeyError(name)
    return total


def wait_for(predicate, timeout: float = 15, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def tcp_listeners(pids: list[int]) -> list[tuple[str, int]]:
    """``(address, port)`` of every listening TCP socket the processes ``pids`` hold, from /proc."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                    found.append(_proc_address(fields[1], family))
    return found


def _proc_address(field: str, family: int) -> tuple[str, int]:
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    # /proc prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw), int(hex_port, 16)
