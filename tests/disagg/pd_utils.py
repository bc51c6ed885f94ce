"""A prefill scheduler and a decode scheduler in one process, with a real bootstrap server, real
side channels and any data path: the PD queues without the servers around them."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from moeserve.config import build_engine_config
from moeserve.core import BootstrapInfo, Req, SamplingParams
from moeserve.disagg.bootstrap import BootstrapTable, build_bootstrap_app
from moeserve.disagg.secret import ensure_secret, read_secret
from moeserve.disagg.transfer.protocol import bootstrap_token
from moeserve.distributed.groups import single
from moeserve.executor.model_runner import ModelRunner
from moeserve.scheduler.roles import make_role
from moeserve.scheduler.scheduler import Scheduler

ENGINE = {"dtype": "float32", "page_size": 4, "max_total_tokens": 1024, "chunked_prefill_size": 16}


@contextlib.contextmanager
def bootstrap_server(secret_file: str, world: int = 1) -> Iterator[tuple[int, BootstrapTable]]:
    """A bootstrap server on a thread, and its port. The socket is bound here, to port 0, and
    handed to uvicorn: a port picked first and bound later could be taken in between."""
    ensure_secret(secret_file)
    table = BootstrapTable(world)
    sock = socket.create_server(("127.0.0.1", 0))
    app = build_bootstrap_app(table, bootstrap_token(read_secret(secret_file)))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1], table
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def pd_scheduler(model_path: str, mode: str, backend: str, bootstrap_port: int, secret_file: str,
                 **settings: object) -> Scheduler:
    config = build_engine_config(model_path, **{**ENGINE, **settings}, disaggregation_mode=mode,
                                 disaggregation_transfer_backend=backend, disaggregation_bootstrap_port=bootstrap_port,
                                 disaggregation_secret_file=secret_file)
    runner = ModelRunner(config)
    return Scheduler(config, runner, None, make_role(mode, config, single(), runner))


def add_pair(prefill: Scheduler, decode: Scheduler, prompts: list[list[int]], params: SamplingParams,
             bootstrap_port: int, first: int = 0) -> list[Req]:
    """Every prompt on both schedulers, as the router sends it; the decode side's requests. Rooms
    and ids are numbered from ``first``."""
    reqs = []
    for i, ids in enumerate(prompts, start=first):
        info = BootstrapInfo("127.0.0.1", bootstrap_port, room=1000 + i)
        prefill.add_request(f"p{i}", ids, params, info)
        reqs.append(decode.add_request(f"d{i}", ids, params, info))
    return reqs


def run_pair(prefill: Scheduler, decode: Scheduler, prompts: list[list[int]], params: SamplingParams,
             bootstrap_port: int, timeout_s: float = 120, first: int = 0) -> list[Req]:
    """Every prompt through both schedulers, stepping them in turn until the decode side is done."""
    reqs = add_pair(prefill, decode, prompts, params, bootstrap_port, first)
    deadline = time.monotonic() + timeout_s
    while not all(r.finished for r in reqs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"unfinished: {[r.rid for r in reqs if not r.finished]}; "
                               f"prefill {prefill.role.stats()}, decode {decode.role.stats()}")
        prefill.step()
        decode.step()
        if not (prefill.ran_forward or decode.ran_forward):
            time.sleep(0.001)
    return reqs


def settle(*scheds: Scheduler, timeout_s: float = 30) -> None:
    """Step the schedulers until none holds a request or a pending transfer (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while any(s.role.num_pending or s.num_requests for s in scheds) and time.monotonic() < deadline:
        for s in scheds:
            s.step()
        time.sleep(0.001)
