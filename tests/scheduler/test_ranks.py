"""Where engine ranks listen: a private directory on one node, the operator's host across nodes."""

import gc
import multiprocessing as mp
import os
import pickle
import signal
import stat
import time
from multiprocessing.synchronize import Event

import pytest

from moeserve.config import ParallelConfig
from moeserve.scheduler.ranks import RankAddresses, stop_ranks


def test_one_node_uses_ipc_in_a_private_directory():
    addrs = RankAddresses.derive(ParallelConfig(tp_size=4, dp_size=4, enable_dp_attention=True))
    try:
        mode = os.stat(addrs.run_dir).st_mode
        assert stat.S_IMODE(mode) == 0o700
        paths = [addrs.output, *addrs.inputs]
        assert len(paths) == 5 and all(p.startswith(f"ipc://{addrs.run_dir}/") for p in paths)
        assert addrs.store == f"file://{addrs.run_dir}/store"
        other = RankAddresses.derive(ParallelConfig(tp_size=2))
        assert other.keys != addrs.keys  # a new launch, new keys
        other.cleanup()
    finally:
        addrs.cleanup()
    assert not os.path.exists(addrs.run_dir)


def test_the_run_dir_goes_with_its_addresses_not_with_a_rank_s_copy():
    addrs = RankAddresses.derive(ParallelConfig(tp_size=2))
    run_dir = addrs.run_dir
    copy = pickle.loads(pickle.dumps(addrs))  # what a spawned rank receives
    assert copy == addrs
    del copy
    gc.collect()
    assert os.path.isdir(run_dir)
    del addrs
    gc.collect()
    assert not os.path.exists(run_dir)


def _ignore_sigterm_and_sleep(ignoring: Event) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ignoring.set()
    time.sleep(120)


def test_stop_ranks_terminates_then_kills_within_its_bound():
    ctx = mp.get_context("spawn")
    ignoring = ctx.Event()
    procs = [ctx.Process(target=time.sleep, args=(120,), daemon=True),
             ctx.Process(target=_ignore_sigterm_and_sleep, args=(ignoring,), daemon=True)]
    for proc in procs:
        proc.start()
    try:
        stop_ranks(procs, [], 0.5, owner_pid=-1)  # a forked child's copy of the finalizer: nothing
        assert all(proc.is_alive() for proc in procs)
        assert ignoring.wait(120)
        start = time.monotonic()
        stop_ranks(procs, [], 0.5, owner_pid=os.getpid())
        assert time.monotonic() - start < 3
        assert [proc.exitcode for proc in procs] == [-signal.SIGTERM, -signal.SIGKILL]
    finally:
        for proc in procs:
            proc.kill()


def test_several_nodes_derive_ports_on_the_chosen_host_and_keys_from_the_secret(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    par = ParallelConfig(tp_size=4, dp_size=2, enable_dp_attention=True, nnodes=2, dist_init_addr="10.1.2.3:5000",
                         dist_secret_file=str(secret))
    node0, node1 = RankAddresses.derive(par), RankAddresses.derive(par)
    assert node0.store == "tcp://10.1.2.3:5000" and node0.output == "tcp://10.1.2.3:5001"
    assert node0.inputs == ("tcp://10.1.2.3:5002", "tcp://10.1.2.3:5003")
    assert node0.keys == node1.keys and node0.run_dir is None
    secret.write_bytes(os.urandom(32))
    assert RankAddresses.derive(par).keys != node0.keys


def test_several_nodes_need_a_long_enough_secret(tmp_path):
    with pytest.raises(ValueError, match="dist_secret_file"):
        ParallelConfig(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:5000")
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    par = ParallelConfig(tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:5000", dist_secret_file=str(short))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RankAddresses.derive(par)
