"""Process groups, built once per rank and passed down explicitly (no module globals).

World of N ranks. ``attn_dp`` data-parallel attention groups of ``attn_tp = N / attn_dp`` ranks
each (rank r is in DP group ``r // attn_tp``); dense-FFN TP groups of ``dense_tp`` consecutive
ranks; expert parallelism over the whole world.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

STORE_TIMEOUT_S = 1800  # ranks of other nodes may start much later than node 0
# How long a gloo collective waits for a peer that is alive but not there yet (torch's default,
# stated). A peer that exits is noticed at once (gloo sees its connection close, ~1-2 s), so this
# only bounds a live peer that is late; and late is normal: model loading and graph capture that
# take longer on one rank, a long CPU prefill that an idle rank's all-to-all waits out (on CPU the
# world group is gloo), a leader held back by a slow reader of its outputs. Shorter could end a
# healthy engine; rank processes whose launcher is gone exit by themselves (``EngineLoop.run``).
GLOO_TIMEOUT = timedelta(minutes=30)
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address

# NVLink multicast (NVLS) buys nothing for these collectives (all-to-alls, gathers, small
# reductions) and costs memory; off, NCCL, torch and NVSHMEM never create multicast objects,
# which need fabric support that not every host has working. Set in each rank process, only
# where the launcher left them unset.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Group:
    """A process group and this rank's place in it; ``group=None`` means a group of one."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    ranks: list[int]

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def leader(self) -> int:
        """Global rank of this group's rank 0."""
        return self.ranks[0]


@dataclass
class ParallelGroups:
    world: Group
    attn_tp: Group
    attn_dp: Group  # the ranks with the same attn_tp rank across DP groups
    dense_tp: Group
    ep: Group
    lm_head: Group
    # gloo twins of world and attn_tp for small host-side messages (step agreement, request
    # broadcast), so NCCL groups only ever see device tensors
    cpu_world: Group | None = None
    cpu_attn_tp: Group | None = None

    def __post_init__(self) -> None:
        self.cpu_world = self.cpu_world or self.world
        self.cpu_attn_tp = self.cpu_attn_tp or self.attn_tp

    @property
    def dp_rank(self) -> int:
        return self.world.rank // self.attn_tp.size

    @property
    def dp_size(self) -> int:
        return self.world.size // self.attn_tp.size


def init_world(init_method: str, rank: int, world_size: int, device: str, local_rank: int = 0) -> None:
    """Join the default process group from a rank process: NCCL on ``device="cuda"`` (bound to GPU
    ``local_rank``), gloo otherwise. Call it before anything else touches CUDA or NCCL.

    ``init_method`` is ``file://PATH`` (ranks of one node) or ``tcp://HOST:PORT``. Every socket
    the backends open listens on ``HOST``'s interface (loopback for a file), never on all of them:
    the store of rank 0 is bound there, and gloo and NCCL are pointed at it unless the operator
    chose an interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).
    """
    store, host = _store(init_method, rank, world_size)
    interface = local_interface(host)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # read when the backends start
        os.environ.setdefault(name, interface)
    if device != "cuda":
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=GLOO_TIMEOUT)
        return
    for name, value in MULTICAST_OFF.items():  # read when NCCL and CUDA first start in this process
        os.environ.setdefault(name, value)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size)


def _store(init_method: str, rank: int, world_size: int) -> tuple[dist.Store, str]:
    """The rendezvous store and the host the ranks meet on."""
    if init_method.startswith("file://"):
        return dist.FileStore(init_method.removeprefix("file://"), world_size), "127.0.0.1"
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    timeout = timedelta(seconds=STORE_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore(host, int(port), world_size, False, timeout), host
    # torch's store server would listen on every interface: hand it a socket bound to ``host``
    listener = socket.create_server((host, int(port)))
    return dist.TCPStore(host, int(port), world_size, True, timeout, master_listen_fd=listener.detach()), host


def local_interface(host: str) -> str:
    """The name of this machine's network interface that reaches ``host`` (``lo`` for loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # a UDP connect sends nothing: it only picks the route
        local_ip = s.getsockname()[0]
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, contextlib.suppress(OSError):
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            if socket.inet_ntoa(packed[20:24]) == local_ip:
                return name
    raise RuntimeError(f"no network interface of this machine has the address {local_ip} (the route to {host})")


def single() -> ParallelGroups:
    """The groups of a one-process engine."""
    one = Group(None, 0, 1, [0])
    return ParallelGroups(one, one, one, one, one, one)


def build_groups(world_size: int, rank: int, attn_tp: int, dense_tp: int, ep_size: int,
                 dp_lm_head: bool) -> ParallelGroups:
    """Create every group (all ranks must call this with the same arguments).

    ``ep_size`` is the world (experts spread over every rank) or 1 (every rank holds all experts).
    """
    world = Group(dist.group.WORLD, rank, world_size, list(range(world_size)))
    tp = _partition(world_size, rank, attn_tp, stride=1)
    dp = _partition(world_size, rank, world_size // attn_tp, stride=attn_tp)
    dense = _partition(world_size, rank, dense_tp, stride=1)
    ep = world if ep_size == world_size else Group(None, 0, 1, [rank])
    cpu_world = cpu_tp = None
    if dist.get_backend() != "gloo":
        cpu_world = Group(dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT), rank, world_size, world.ranks)
        cpu_tp = _partition(world_size, rank, attn_tp, stride=1, backend="gloo")
    # with a DP LM head, each DP group runs the vocab-parallel head for its own tokens only
    return ParallelGroups(world, tp, dp, dense, ep, tp if dp_lm_head else world, cpu_world, cpu_tp)


def _partition(world_size: int, rank: int, size: int, stride: int, backend: str | None = None) -> Group:
    """Split the world into groups of ``size`` ranks, ranks ``stride`` apart; return ours.

    ``new_group`` is collective over the world, so every rank creates every group.
    """
    mine = None
    for block in range(world_size // (size * stride)):
        for offset in range(stride):
            ranks = [block * size * stride + offset + i * stride for i in range(size)]
            timeout = GLOO_TIMEOUT if backend == "gloo" else None  # None: the world's backend's default
            group = dist.new_group(ranks, backend=backend, timeout=timeout) if size > 1 else None
            if rank in ranks:
                mine = Group(group, ranks.index(rank), size, ranks)
    assert mine is not None
    return mine
