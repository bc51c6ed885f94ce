"""Two real processes, a "prefill" rank and a "decode" rank, moving bytes with one transfer
backend: the conformance check every data path must pass (any backend name works)."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import time
import traceback

import torch

LAYERS, SLOTS, DIM, AUX_SLOTS, AUX_WIDTH = 3, 64, 40, 8, 6
TIMEOUT_S = 60


def backend_available(name: str) -> bool:
    """Whether the backend's library imports here (Mooncake also needs libibverbs1). CI sets
    MOESERVE_REQUIRE_BACKENDS=1, where a missing library is an error instead of a skip."""
    module = {"nixl": "nixl._api", "mooncake": "mooncake.engine"}.get(name)
    if module is None:
        return True
    try:
        importlib.import_module(module)
    except ImportError:
        if os.environ.get("MOESERVE_REQUIRE_BACKENDS") == "1":
            raise
        return False
    return True


def buffers(fill: float, device: str = "cpu") -> list[torch.Tensor]:
    """A KV cache [layers, slots, dim] (bf16) and aux records [slots, width] (float64)."""
    kv = torch.full((LAYERS, SLOTS, DIM), fill, dtype=torch.bfloat16, device=device)
    aux = torch.full((AUX_SLOTS, AUX_WIDTH), fill, dtype=torch.float64, device=device)
    return [kv, aux]


def _source(device: str = "cpu") -> list[torch.Tensor]:
    kv = torch.arange(LAYERS * SLOTS * DIM, dtype=torch.float32).remainder(251).to(torch.bfloat16)
    aux = torch.arange(AUX_SLOTS * AUX_WIDTH, dtype=torch.float64).view(AUX_SLOTS, -1)
    return [kv.view(LAYERS, SLOTS, DIM).to(device), aux.to(device)]


def _pieces():
    """Slots 4..12 of every layer to slots 20..28, slot 40 to slot 1, aux record 2 to record 5."""
    from moeserve.disagg.transfer.base import Piece

    row = DIM * 2  # bytes of one bf16 slot
    layer = SLOTS * row
    out = []
    for layer_id in range(LAYERS):
        out.append(Piece(0, layer_id * layer + 4 * row, layer_id * layer + 20 * row, 8 * row))
        out.append(Piece(0, layer_id * layer + 40 * row, layer_id * layer + 1 * row, row))
    out.append(Piece(1, 2 * AUX_WIDTH * 8, 5 * AUX_WIDTH * 8, AUX_WIDTH * 8))
    return out


def expected_decode_buffers() -> list[torch.Tensor]:
    kv, aux = buffers(-1.0)
    src_kv, src_aux = _source()
    kv[:, 20:28] = src_kv[:, 4:12]
    kv[:, 1] = src_kv[:, 40]
    aux[5] = src_aux[2]
    return [kv, aux]


def _decode(name: str, conn, written, read, device: str) -> None:
    try:
        from moeserve.disagg.transfer.base import create_backend

        bufs = buffers(-1.0, device)
        backend = create_backend(name, bufs, "127.0.0.1")
        conn.send(("descriptor", backend.descriptor()))
        deadline = time.monotonic() + TIMEOUT_S
        while not written.wait(0.002):  # as the transfer loop does, so the backend progresses
            backend.progress()
            assert time.monotonic() < deadline, "the prefill side never finished"
        conn.send(("buffers", [b.cpu() for b in bufs]))
        assert read.wait(TIMEOUT_S)  # stay alive until the parent has read
        backend.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _prefill(name: str, conn, descriptor, written, read, rounds: int, device: str) -> None:
    try:
        from moeserve.disagg.transfer.base import KVPoll, create_backend

        backend = create_backend(name, _source(device), "127.0.0.1")
        backend.connect("decode-0", descriptor)
        states = []
        for _ in range(rounds):
            handle = backend.write("decode-0", _pieces())
            deadline = time.monotonic() + TIMEOUT_S
            while (state := backend.check(handle)) is KVPoll.Transferring and time.monotonic() < deadline:
                time.sleep(0.001)
            states.append(int(state))
        conn.send(("states", states))
        written.set()
        assert read.wait(TIMEOUT_S)
        backend.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))
        written.set()


def run_pair(name: str, rounds: int = 2, device: str = "cpu") -> tuple[list[int], list[torch.Tensor]]:
    """The transfer states the prefill side saw and the decode side's buffers afterwards."""
    ctx = mp.get_context("spawn")
    written, read = ctx.Event(), ctx.Event()
    d_parent, d_child = ctx.Pipe()
    p_parent, p_child = ctx.Pipe()
    decode = ctx.Process(target=_decode, args=(name, d_child, written, read, device), daemon=True)
    decode.start()
    try:
        kind, value = _recv(d_parent)
        prefill = ctx.Process(target=_prefill, args=(name, p_child, value, written, read, rounds, device),
                              daemon=True)
        prefill.start()
        _, states = _recv(p_parent)
        _, got = _recv(d_parent)
        read.set()
        prefill.join(TIMEOUT_S)
        decode.join(TIMEOUT_S)
        assert (prefill.exitcode, decode.exitcode) == (0, 0), "a side of the pair did not exit cleanly"
        return states, got
    finally:
        for proc in (decode, locals().get("prefill")):
            if proc is not None and proc.is_alive():
                proc.kill()


def _recv(conn):
    if not conn.poll(TIMEOUT_S * 2):
        raise TimeoutError("a side of the pair did not answer")
    kind, value = conn.recv()
    if kind == "error":
        raise AssertionError(value)
    return kind, value
