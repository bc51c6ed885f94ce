"""``moeserve bench transfer``: KV transfer bandwidth of a backend between two processes on this
machine, for a few shapes of work: one large contiguous run, and many page-sized pieces (the shape
of a prompt's KV pages of many layers when the pages are scattered).

Bandwidth counts the bytes that reached the other process over the time from the first ``write``
to its ``Success``, after one untimed warm-up write of the same shape.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
import traceback
from typing import Any

import torch

SHAPES = {"one 64 MiB run": (1, 64 << 20), "4096 x 16 KiB pieces": (4096, 16 << 10),
          "61 layers x 32 pages of 36 KiB": (61 * 32, 36 << 10)}
TIMEOUT_S = 120


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", nargs="+", default=["torch"], choices=["torch", "nixl", "mooncake"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, metavar="PATH")


def _buffer(nbytes: int, device: str) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _pieces(count: int, size: int) -> list:
    """Every other slot of a buffer twice the size, so no two pieces are adjacent (nothing merges)."""
    from moeserve.disagg.transfer.base import Piece

    return [Piece(0, 2 * i * size, 2 * i * size, size) for i in range(count)]


def _receiver(backend: str, device: str, nbytes: int, conn, done) -> None:
    try:
        from moeserve.disagg.transfer.base import create_backend

        b = create_backend(backend, [_buffer(nbytes, device)], "127.0.0.1")
        conn.send(b.descriptor())
        deadline = time.monotonic() + TIMEOUT_S * 4
        while not done.wait(0.002) and time.monotonic() < deadline:
            b.progress()  # as the manager's thread does
        b.close()
    except Exception:
        conn.send({"error": traceback.format_exc()})


def _sender(backend: str, device: str, nbytes: int, descriptor: dict, repeats: int) -> dict[str, float]:
    from moeserve.disagg.transfer.base import KVPoll, create_backend

    b = create_backend(backend, [_buffer(nbytes, device)], "127.0.0.1")
    started = time.perf_counter()
    b.connect("peer", descriptor)
    out = {"connect_ms": 1e3 * (time.perf_counter() - started)}
    for name, (count, size) in SHAPES.items():
        pieces = _pieces(count, size)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            handle = b.write("peer", pieces)
            while (state := b.check(handle)) is KVPoll.Transferring:
                time.sleep(0.0002)
            if state is not KVPoll.Success:
                raise RuntimeError(f"{backend}: a write of {name} failed")
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
        out[name] = count * size / statistics.median(times) / 1e9
    b.close()
    return out


def measure(backend: str, device: str, repeats: int) -> dict[str, float]:
    """GB/s per shape (and the connect time) for one backend, receiver in a second process."""
    nbytes = max(2 * count * size for count, size in SHAPES.values())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    done = ctx.Event()
    proc = ctx.Process(target=_receiver, args=(backend, device, nbytes, child, done), daemon=True)
    proc.start()
    try:
        if not parent.poll(TIMEOUT_S):
            raise TimeoutError(f"{backend}: the receiving process did not start")
        descriptor = parent.recv()
        if "error" in descriptor:
            raise RuntimeError(descriptor["error"])
        return _sender(backend, device, nbytes, descriptor, repeats)
    finally:
        done.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def run_transfer_benchmark(args: argparse.Namespace) -> str:
    results: dict[str, Any] = {b: measure(b, args.device, args.repeats) for b in args.backend}
    names = ["connect_ms", *SHAPES]
    title = f"KV transfer between two processes on this machine ({args.device} buffers), GB/s (median of {args.repeats})"
    lines = [title, f"{'backend':<10}" + "".join(f"{n:>32}" for n in names)]
    for backend, row in results.items():
        lines.append(f"{backend:<10}" + "".join(f"{row[n]:>32.2f}" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "repeats": args.repeats, "results": results}, f, indent=2)
    return "\n".join(lines)
