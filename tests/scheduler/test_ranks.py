"""Where engine ranks listen: a private directory on one node, the operator's host across nodes."""

import os
import stat

import pytest

from moeserve.config import ParallelConfig
from moeserve.scheduler.ranks import RankAddresses


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
