"""Models of the expert-parallel all-to-all's time, for the one-rank emulator (``bench rank``): what a
dispatch or a combine of one MoE layer would take on a real network, given what one rank sends.

Every figure here is **modelled**, not measured on this machine. Three models:

- ``deepep``: DeepEP's published figures (its README's V1 tables, "legacy" docs since its V2;
  H800 with ~160 GB/s NVLink and one CX7 400 Gb/s InfiniBand NIC per GPU; 7168 hidden, top-8,
  FP8 dispatch, BF16 combine). Normal kernels: bottleneck bandwidth by EP size (EP8 intranode over
  NVLink 153 / 158 GB/s dispatch / combine; internode over RDMA: EP16 43 / 43, EP32 58 / 57, EP64
  51 / 50 GB/s), the bytes counted as its tests count them: intranode, the tokens a rank receives
  (one per token and receiving rank); internode, one per token and destination node, the
  sender's own node included (``tests/test_internode.py``). Low-latency kernels: latency at 128
  tokens a rank by EP size (dispatch 77 / 118 / 155 / 173 / 192 / 194 us and combine 114 / 195 /
  273 / 314 / 369 / 360 us at EP 8 / 16 / 32 / 64 / 128 / 256, after DeepEP's NVLink-aware
  low-latency kernels of 2025-06), scaled by the tokens sent (its bytes are every (token, expert)
  pair). Between EP sizes the figures are interpolated on log(EP); past the table, its last entry.
- ``ib400``: a plain bandwidth and latency model of one 400 Gb/s NIC per GPU (50 GB/s) and NVLink
  inside an 8-GPU node (H100/H200 NVLink 4: 450 GB/s a direction, taken at 80%), 15 us a call:
  the internode bytes (one per token and remote node, as DeepEP sends them) over the NIC, the
  intranode ones (one per token and other local rank) over NVLink, whichever takes longer.
- ``measured:PATH``: ``moeserve bench dispatch --output-json PATH`` from a multi-GPU machine: its
  best normal-mode rate (DeepEP's count) and its best low-latency time per token.

A dispatch's receiver and a combine's sender is the busiest rank, which moves ``1 / balancedness``
times the mean: every time is scaled by that.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

FP8_BYTES = 1 + 4 / 128  # a value and its share of the 1x128 group's fp32 scale
BF16_BYTES = 2

# DeepEP README (V1), H800 + CX7 400 Gb/s: {ep_size: (dispatch GB/s, combine GB/s)}
DEEPEP_NORMAL_GBPS = {8: (153.0, 158.0), 16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
# {ep_size: (dispatch us, combine us)} at 128 tokens per rank
DEEPEP_LL_US = {8: (77.0, 114.0), 16: (118.0, 195.0), 32: (155.0, 273.0), 64: (173.0, 314.0),
                128: (192.0, 369.0), 256: (194.0, 360.0)}
DEEPEP_LL_TOKENS = 128


@dataclass(frozen=True)
class Traffic:
    """One dispatch or combine of one MoE layer, as one rank sees it."""

    tokens: int  # this rank's tokens in the call
    hidden: int
    top_k: int
    ep_size: int
    gpus_per_node: int = 8
    balancedness: float = 1.0

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.ep_size / self.gpus_per_node))

    def distinct(self, bins: int, limit: int | None = None) -> float:
        """Expected distinct bins among a token's ``top_k`` experts spread evenly over ``bins``."""
        hit = bins * (1 - (1 - 1 / bins) ** self.top_k)
        return min(hit, limit) if limit else hit

    def token_bytes(self, op: str) -> float:
        return self.hidden * (FP8_BYTES if op == "dispatch" else BF16_BYTES)


def _interp(table: dict[int, tuple[float, float]], ep: int, col: int) -> float:
    """The table's figure at ``ep``, on log(EP) between entries, clamped at its ends."""
    keys = sorted(table)
    if ep <= keys[0]:
        return table[keys[0]][col]
    if ep >= keys[-1]:
        return table[keys[-1]][col]
    hi = next(k for k in keys if k >= ep)
    lo = max(k for k in keys if k <= ep)
    if hi == lo:
        return table[lo][col]
    w = (math.log(ep) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return table[lo][col] * (1 - w) + table[hi][col] * w


class NetworkModel:
    name = "model"
    source = ""

    def seconds(self, mode: str, op: str, traffic: Traffic) -> float:
        """The time of one ``op`` ("dispatch" | "combine") in ``mode`` ("normal" | "low_latency")."""
        if traffic.ep_size == 1 or traffic.tokens == 0:
            return 0.0
        return self._seconds(mode, op, traffic) / traffic.balancedness

    def _seconds(self, mode: str, op: str, traffic: Traffic) -> float:
        raise NotImplementedError


class DeepEPModel(NetworkModel):
    name = "deepep"
    source = "DeepEP README (V1 tables): H800, NVLink ~160 GB/s, CX7 400 Gb/s IB; FP8 dispatch, BF16 combine"

    def _seconds(self, mode, op, t):
        col = 0 if op == "dispatch" else 1
        if mode == "low_latency":
            return _interp(DEEPEP_LL_US, t.ep_size, col) * 1e-6 * t.tokens / DEEPEP_LL_TOKENS
        gbps = _interp(DEEPEP_NORMAL_GBPS, t.ep_size, col)
        if t.ep_size <= t.gpus_per_node:  # NVLink: the tokens a rank receives, once per receiving rank
            copies = t.distinct(t.ep_size)
        else:  # RDMA: once per destination node (its own included), at most 4 nodes a token (DeepSeek's routing)
            copies = t.distinct(t.nodes, limit=4)
        return t.tokens * copies * t.token_bytes(op) / (gbps * 1e9)


class PlainIBModel(NetworkModel):
    name = "ib400"
    source = "400 Gb/s InfiniBand per GPU (50 GB/s), NVLink 4 at 80% of 450 GB/s, 15 us per call"
    ib_gbps, nvlink_gbps, latency_s = 50.0, 0.8 * 450.0, 15e-6

    def _seconds(self, mode, op, t):
        per_token = t.token_bytes(op)
        local = min(t.ep_size, t.gpus_per_node)
        if mode == "low_latency":  # every (token, expert) pair, straight to its rank
            remote_share = 1 - local / t.ep_size
            inter = t.tokens * t.top_k * remote_share * per_token
            intra = t.tokens * t.top_k * (1 - remote_share) * per_token * (local - 1) / max(local, 1)
        else:  # once per remote node, then forwarded inside it; once per other local rank
            inter = t.tokens * t.distinct(t.nodes, limit=4) * (1 - 1 / t.nodes) * per_token
            intra = t.tokens * t.distinct(local) * (local - 1) / local * per_token
        return self.latency_s + max(inter / (self.ib_gbps * 1e9), intra / (self.nvlink_gbps * 1e9))


class MeasuredModel(NetworkModel):
    """``bench dispatch --output-json`` of a real run: normal at its best DeepEP-count rate, low
    latency at its best time per token (both at the EP size it ran, whatever ``ep_size`` asks)."""

    name = "measured"

    def __init__(self, path: str) -> None:
        with open(path) as f:
            report = json.load(f)
        rows = report.get("rows")
        if not rows:
            raise ValueError(f"--network measured:{path}: no 'rows' (write it with bench dispatch --output-json)")
        self.rates, self.per_token = {}, {}
        for r in rows:
            key = r["op"]
            if r["mode"] == "normal" and r.get("gbps_deepep"):
                self.rates[key] = max(self.rates.get(key, 0.0), float(r["gbps_deepep"]))
            elif r["mode"] == "low_latency":
                us = float(r["time_us"]) / int(r["tokens_per_rank"])
                self.per_token[key] = min(self.per_token.get(key, math.inf), us)
        world = report.get("config", {}).get("world_size")
        self.source = f"measured by bench dispatch ({report.get('device_name', '?')}, EP {world}): {path}"

    def _seconds(self, mode, op, t):
        if mode == "low_latency":
            if op not in self.per_token:
                raise ValueError(f"the measured report has no low-latency {op} row")
            return self.per_token[op] * 1e-6 * t.tokens
        if op not in self.rates:
            raise ValueError(f"the measured report has no normal {op} row")
        return t.tokens * t.distinct(min(t.ep_size, t.gpus_per_node)) * t.token_bytes(op) / (self.rates[op] * 1e9)


def network_model(spec: str) -> NetworkModel:
    """``deepep``, ``ib400`` or ``measured:PATH``."""
    if spec == "deepep":
        return DeepEPModel()
    if spec == "ib400":
        return PlainIBModel()
    if spec.startswith("measured:"):
        return MeasuredModel(spec.removeprefix("measured:"))
    raise ValueError(f"--network: unknown model {spec!r}; choose deepep, ib400 or measured:PATH")
