"""Disaggregated serving under faults, real processes on loopback with the torch data path: a prefill
server killed mid-load, a decode server killed mid-load, bad input and stray bytes, and the chaos run.
Nothing hangs, nothing leaks, and whatever completes equals the single engine."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from moeserve.server import procs
from tests.disagg.chaos import (
    ChaosConfig,
    bootstrap_port,
    complete,
    deployment,
    greedy,
    kill,
    pages_used,
    references,
    run_chaos,
    tiny_model,
)
from tests.e2e.server_utils import metric, wait_for

LONG = ["A list of numbers: " + " ".join(str(i) for i in range(k, k + 120)) for k in range(8)]  # ~10 chunks each
SHORT = ["The capital of", "abc", "Hello there, how"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("pdf")))


@pytest.fixture(scope="module")
def want(model_path):
    return references(model_path, [(p, 24) for p in LONG + SHORT] + [(p, 6) for p in SHORT])


def _router_healthy(router: procs.Proc, worker: procs.Proc) -> float:
    return metric(router.url, "moeserve_router:worker_healthy", url=worker.url)


async def _through_router(router: procs.Proc, prompts: list[str], max_tokens: int = 24) -> list:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        return await asyncio.gather(*(complete(http, f"{router.url}/v1/completions",
                                               greedy(p, max_tokens, stream=i % 2 == 1))
                                      for i, p in enumerate(prompts)))


def _check_ok(outcomes: list, prompts: list[str], want: dict, max_tokens: int = 24) -> None:
    for out, prompt in zip(outcomes, prompts):
        assert out.kind == "ok", (out.status, out.message)
        assert out.text == want[(prompt, max_tokens)]


async def _busy(server: procs.Proc, queues: tuple[str, ...], at_least: int = 1) -> None:
    """Until ``server`` holds ``at_least`` requests in ``queues`` together (PD queues; "waiting": its
    prefill queue)."""
    def held() -> float:
        return sum(metric(server.url, "moeserve:num_queue_reqs") if q == "waiting"
                   else metric(server.url, "moeserve:pd_queue_reqs", queue=q) for q in queues)
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(held) < at_least:
        assert time.monotonic() < deadline, f"{server.name} never held {at_least} requests in {queues}"
        await asyncio.sleep(0.02)


def test_a_killed_prefill_server_fails_only_its_requests_and_comes_back(model_path, want, tmp_path):
    servers = deployment(model_path, str(tmp_path), num_prefill=2,
                         server_args=["--disaggregation-bootstrap-timeout", "60",
                                      "--disaggregation-waiting-timeout", "60", "--disable-radix-cache"])
    with procs.running(servers):
        p0, p1, decode, router = servers
        prompts = LONG * 2

        def leg(prompt: str, room: int) -> dict:
            return {**greedy(prompt, 6), "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port(p0),
                    "bootstrap_room": room}

        async def scenario():
            async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
                load = [asyncio.ensure_future(complete(http, f"{router.url}/v1/completions",
                                                       greedy(p, 24, stream=i % 2 == 1)))
                        for i, p in enumerate(prompts)]
                # requests that only p0's death can end, whatever the timing: prefill legs on p0 whose decode
                # leg never comes (p0 holds them in its bootstrap queue), and decode legs naming p0 whose prefill
                # leg never comes (the decode server holds their pages until the heartbeat finds p0 dead)
                held = [asyncio.ensure_future(complete(http, f"{p0.url}/v1/completions",
                                                       leg(SHORT[1], random.getrandbits(62)))) for _ in range(2)]
                orphans = [asyncio.ensure_future(complete(http, f"{decode.url}/v1/completions",
                                                          leg(SHORT[0], random.getrandbits(62)))) for _ in range(3)]
                await _busy(p0, ("bootstrap",), at_least=2)
                await _busy(decode, ("transfer",), at_least=3)
                await asyncio.to_thread(kill, p0)
                killed = time.monotonic()
                return (await asyncio.gather(*load), await asyncio.gather(*held), await asyncio.gather(*orphans),
                        killed)

        outcomes, held, orphans, killed = asyncio.run(scenario())
        for out in held:
            assert out.kind == "error", out
        for orphan in orphans:  # within the heartbeat window: 2 misses of 0.5 s, plus the time to notice
            assert orphan.kind == "error" and "missed 2 health checks" in orphan.message, orphan.message
            assert orphan.ended - killed < 10
        # the load: p1's requests complete (and p0's that finished before it died), p0's others fail with a 5xx
        ok = [(o, p) for o, p in zip(outcomes, prompts) if o.kind == "ok"]
        assert ok and all(o.text == want[(p, 24)] for o, p in ok)
        assert all(o.kind == "error" and (o.status >= 500 or o.status == 0) for o in outcomes if o.kind != "ok")
        assert wait_for(lambda: _router_healthy(router, p0) == 0, timeout=10)
        _check_ok(asyncio.run(_through_router(router, LONG[:4])), LONG[:4], want)  # no restart: p1 serves
        assert wait_for(lambda: pages_used(decode) == 0 and pages_used(p1) == 0, timeout=30)
        assert metric(decode.url, "moeserve:pd_prefill_peers_lost") >= 1

        servers[0] = p0 = procs.restart(p0)  # same port, same bootstrap port
        assert wait_for(lambda: _router_healthy(router, p0) == 1, timeout=10)
        _check_ok(asyncio.run(_through_router(router, SHORT * 2)), SHORT * 2, want)
        # round robin reached it again (its ranks report their counts every stats interval)
        assert wait_for(lambda: metric(p0.url, "moeserve:kv_transfers", result="success") >= 1, timeout=10)
        assert wait_for(lambda: all(pages_used(s) == 0 for s in servers[:-1]), timeout=30)


def test_a_killed_decode_server_frees_the_prefill_servers_rooms(model_path, want, tmp_path):
    servers = deployment(model_path, str(tmp_path), num_decode=2,
                         server_args=["--disaggregation-bootstrap-timeout", "3",
                                      "--disaggregation-transfer-timeout", "3", "--disable-radix-cache"])
    with procs.running(servers):
        prefill, d0, d1, router = servers

        async def scenario():
            async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
                load = [asyncio.ensure_future(complete(http, f"{router.url}/v1/completions",
                                                       greedy(p, 24, stream=i % 2 == 1)))
                        for i, p in enumerate(LONG * 2)]
                # both legs sent by hand, no router: only the prefill server's own timeouts can end its leg
                rooms = [random.getrandbits(62) for _ in range(3)]
                bodies = [{**greedy(LONG[i], 24), "bootstrap_host": "127.0.0.1",
                           "bootstrap_port": bootstrap_port(prefill), "bootstrap_room": r} for i, r in enumerate(rooms)]
                direct = [asyncio.ensure_future(complete(http, f"{prefill.url}/v1/completions", b)) for b in bodies]
                d0_legs = [asyncio.ensure_future(complete(http, f"{d0.url}/v1/completions", b)) for b in bodies]
                await _busy(d0, ("transfer",))
                await asyncio.to_thread(kill, d0)
                killed = time.monotonic()
                await asyncio.gather(*d0_legs)
                return await asyncio.gather(*load), await asyncio.gather(*direct), killed

        outcomes, direct, killed = asyncio.run(scenario())
        assert all(o.kind in ("ok", "error") for o in outcomes)
        for o in direct:  # ended by the bootstrap or transfer timeout (3 s), or done before the kill
            assert o.kind == "ok" or o.status >= 500, o
            assert o.ended - killed < 3 + 10
        assert wait_for(lambda: pages_used(prefill) == 0, timeout=15)
        assert metric(prefill.url, "moeserve:pd_queue_reqs") == 0
        assert wait_for(lambda: _router_healthy(router, d0) == 0, timeout=10)
        _check_ok(asyncio.run(_through_router(router, LONG[:4])), LONG[:4], want)  # d1 serves everything now
        assert wait_for(lambda: pages_used(prefill) == 0 and pages_used(d1) == 0, timeout=30)


def test_chaos_every_request_ends_correct_or_with_an_error_and_nothing_leaks(model_path, tmp_path):
    """Every fault kind of the full run (``python -m tests.disagg.chaos``: 1,000 requests, docs/reliability.md)
    at a fifth of its requests: client disconnects, injected transfer failures, a prefill server killed
    and restarted under load."""
    summary = run_chaos(model_path, str(tmp_path), ChaosConfig(requests=200, concurrency=48))
    print(summary)
    outcomes, causes = summary["outcomes"], summary["errors_by_cause"]
    assert "hung" not in outcomes, summary
    assert sum(outcomes.values()) == 200
    assert outcomes.get("ok", 0) > 0 and outcomes.get("error", 0) > 0 and outcomes.get("disconnected", 0) > 0
    assert causes.get("injected transfer failure", 0) > 0, summary
    assert summary["mismatched"] == 0, summary
    assert summary["drained"] and all(v == 0 for v in summary["pages_used_after"].values()), summary
    assert all(code == 200 for code in summary["health_generate"].values()), summary
    assert not any(c.startswith("other") for c in summary["errors_by_cause"]), summary
