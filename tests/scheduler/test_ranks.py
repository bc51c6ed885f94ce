"""Where engine ranks listen when no --dist-init-addr is given."""

import socket

from moeserve.config import ParallelConfig
from moeserve.scheduler import ranks
from moeserve.scheduler.ranks import RankAddresses, free_port_run


def _ports(addrs: RankAddresses) -> list[int]:
    return [int(a.rsplit(":", 1)[1]) for a in (addrs.dist_init, addrs.output, *addrs.inputs)]


def test_derived_ports_are_one_free_run():
    addrs = RankAddresses.derive(ParallelConfig(tp_size=4, dp_size=4, enable_dp_attention=True))
    ports = _ports(addrs)
    assert ports == list(range(ports[0], ports[0] + 6))
    for port in ports:  # all of them can still be bound
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_run_with_a_taken_neighbour_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1] - 1  # a free port whose neighbour is in use
        candidates = iter([busy, ranks.free_port()])
        monkeypatch.setattr(ranks, "free_port", lambda: next(candidates))
        base = free_port_run(3)
        assert base != busy
        assert not base <= taken.getsockname()[1] < base + 3
