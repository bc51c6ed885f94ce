"""How evenly an expert workload loads the GPUs of an EP deployment, modelled on the CPU: the
balancedness of recorded or synthetic routing (``workload.Routing``) at any EP size and redundancy,
with and without EPLB. Nothing here runs a model; every figure is simulated.

The model. The routing is replayed in batches of ``tokens_per_gpu * N`` tokens (a step of an EP
deployment of ``N`` GPUs), tokens in order, wrapping around at the end. A batch's ``counts
[B, L, E]`` (token-expert pairs routed to each logical expert) is spread over the ``P`` slots of a
placement ``phy2log``: an expert with several replicas has its tokens split evenly over them (what
the ``dynamic`` dispatch does in expectation, and ``static`` does when the ranks' traffic is alike),
so a GPU's load is the sum over its ``P / N`` slots (``algorithm.gpu_loads``). MoE compute of a
layer is taken as proportional to its busiest GPU's tokens, so per batch and layer:

- balancedness = mean / max tokens per GPU (1 is perfect);
- relative MoE time = sum of max / sum of mean over batches and layers: the MoE time against a
  perfectly balanced run of the same tokens.

Placements (``N`` GPUs on ``K = N / gpus_per_node`` nodes; sizes as in ``algorithm.py``):
- ``trivial``: no EPLB, the placement a server starts with (``trivial_phy2log``: the experts in
  order, then replicas of experts 0, 1, … in the redundant slots);
- ``eplb``: ``rebalance_experts`` on the counts of the whole workload (or of another one);
- ``online``: ``rebalance_experts`` every ``rebalance_every`` batches on the counts of the window of
  batches just before (what ``--enable-eplb`` does); the first window runs an initial placement.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.eplb.algorithm import gpu_loads, rebalance_experts, trivial_phy2log
from moeserve.eplb.workload import Routing, mix_routing

SETTING_NAMES = {"trivial": "no EPLB", "eplb": "EPLB", "online": "EPLB online", "stale": "EPLB on A (stale)",
                 "ceiling": "EPLB on traffic (ceiling)"}


@dataclass(frozen=True)
class Deployment:
    """``ep_size`` GPUs, ``gpus_per_node`` to a node, ``num_logical + redundant`` slots."""

    ep_size: int
    num_logical: int
    redundant: int
    gpus_per_node: int = 8

    @property
    def num_physical(self) -> int:
        return self.num_logical + self.redundant

    @property
    def num_nodes(self) -> int:
        return max(1, self.ep_size // self.gpus_per_node)

    def policy(self, num_groups: int) -> str:
        return "hierarchical" if num_groups % self.num_nodes == 0 else "global"

    def unfit(self) -> str | None:
        """Why this deployment cannot exist, or None."""
        if self.num_physical % self.ep_size:
            return f"{self.ep_size} GPUs do not divide the {self.num_physical} slots"
        if self.ep_size > self.gpus_per_node and self.ep_size % self.gpus_per_node:
            return f"{self.ep_size} GPUs are not whole nodes of {self.gpus_per_node}"
        return None

    def describe(self) -> dict[str, Any]:
        return {"ep_size": self.ep_size, "redundant": self.redundant, "num_physical": self.num_physical,
                "num_nodes": self.num_nodes}


def deployments(ep_sizes: list[int], redundants: list[int], num_logical: int,
                gpus_per_node: int) -> tuple[list[Deployment], list[dict[str, Any]]]:
    """The deployments of every (redundancy, EP size) that fit, and the skipped ones with why."""
    fit, skipped = [], []
    for redundant in redundants:
        for ep_size in ep_sizes:
            dep = Deployment(ep_size, num_logical, redundant, gpus_per_node)
            reason = dep.unfit()
            if reason:
                skipped.append({**dep.describe(), "reason": reason})
            else:
                fit.append(dep)
    return fit, skipped


# ---- the model ---------------------------------------------------------------------------------------
def batch_counts(routing: Routing, batch_tokens: int, num_batches: int | None = None) -> torch.Tensor:
    """``[B, L, E]`` float64: token-expert pairs per logical expert in each batch of ``batch_tokens``
    consecutive tokens (wrapping around); ``B`` covers the routing once unless given."""
    tokens, num_logical = routing.num_tokens, routing.num_logical
    batches = num_batches or max(1, math.ceil(tokens / batch_tokens))
    whole, rest = divmod(batch_tokens, tokens)  # a batch = ``whole`` passes over every token + ``rest`` more
    counts = routing.counts().to(torch.float64).mul(whole).expand(batches, -1, -1).clone()  # [B, L, E]
    if rest:
        start = torch.arange(batches) * batch_tokens % tokens  # [B]
        index = (start.unsqueeze(1) + torch.arange(rest)).flatten() % tokens  # [B * rest]
        key_base = (torch.arange(batches) * num_logical).repeat_interleave(rest).unsqueeze(1)  # [B * rest, 1]
        for layer in range(routing.num_layers):
            key = key_base + routing.topk_ids[layer, index].long()  # [B * rest, k]
            counts[:, layer] += torch.bincount(key.flatten(), minlength=batches * num_logical).view(batches, -1)
    return counts


def batch_gpu_loads(counts: torch.Tensor, phy2log: torch.Tensor, ep_size: int) -> torch.Tensor:
    """``[B, L, N]`` tokens per GPU of ``counts [B, L, E]`` placed by ``phy2log`` (``[L, P]``, or one
    per batch ``[B, L, P]``), each expert's tokens split evenly over its replicas."""
    batches, layers, num_logical = counts.shape
    phy2log = phy2log.expand(batches, layers, -1).reshape(batches * layers, -1)
    return gpu_loads(phy2log, counts.reshape(batches * layers, num_logical), ep_size).view(batches, layers, ep_size)


def summarize(loads: torch.Tensor, layer_ids: tuple[int, ...]) -> dict[str, Any]:
    """The figures of ``loads [B, L, N]``, overall and per layer; batches where a layer routed no
    token are left out."""
    mean, peak = loads.mean(-1), loads.max(-1).values  # [B, L]
    loaded = peak > 0
    ratio = torch.where(loaded, mean / peak.clamp(min=1e-300), 0.0)
    n = loaded.sum(0)  # [L] batches with load
    per_layer = {"layer_ids": list(layer_ids),
                 "balancedness": _per_layer(ratio.sum(0), n), "max_gpu_tokens": _per_layer(peak.sum(0), n),
                 "relative_moe_time": _per_layer(peak.sum(0), mean.sum(0) * (n > 0))}
    if not loaded.any():
        return {"balancedness": 1.0, "max_gpu_tokens": 0.0, "mean_gpu_tokens": 0.0, "relative_moe_time": 1.0,
                "per_layer": per_layer}
    return {"balancedness": float(ratio[loaded].mean()), "max_gpu_tokens": float(peak[loaded].mean()),
            "mean_gpu_tokens": float(mean[loaded].mean()),
            "relative_moe_time": float(peak[loaded].sum() / mean[loaded].sum()), "per_layer": per_layer}


def _per_layer(numerator: torch.Tensor, denominator: torch.Tensor) -> list[float | None]:
    return [None if d == 0 else n / d for n, d in zip(numerator.tolist(), denominator.tolist())]


# ---- placements ----------------------------------------------------------------------------------------
def plan(weight: torch.Tensor, dep: Deployment, num_groups: int) -> torch.Tensor:
    """``phy2log [L, P]`` of ``rebalance_experts`` on ``weight [L, E]`` for ``dep``."""
    return rebalance_experts(weight, dep.num_physical, num_groups, dep.num_nodes, dep.ep_size)[0]


def trivial(dep: Deployment, num_layers: int) -> torch.Tensor:
    return trivial_phy2log(num_layers, dep.num_logical, dep.num_physical)


def online(counts: torch.Tensor, every: int, initial: torch.Tensor, dep: Deployment,
           num_groups: int) -> torch.Tensor:
    """``[B, L, P]``: ``initial [L, P]`` for the first ``every`` batches; then each window of
    ``every`` batches runs the placement planned on the counts of the window before it."""
    batches = counts.shape[0]
    phy2log = initial.expand(batches, -1, -1).clone()
    for start in range(every, batches, every):
        phy2log[start:start + every] = plan(counts[start - every:start].sum(0), dep, num_groups)
    return phy2log


# ---- the experiments -------------------------------------------------------------------------------
def simulate(routing: Routing, ep_sizes: list[int], redundants: list[int], *, tokens_per_gpu: int = 128,
             gpus_per_node: int = 8, placement_counts: torch.Tensor | None = None,
             rebalance_every: int | None = None, num_batches: int | None = None) -> dict[str, Any]:
    """Each setting (``trivial``, ``eplb`` placed on ``placement_counts [L, E]`` or the routing's own
    counts, ``online`` when ``rebalance_every`` is given, starting from ``trivial``) at each
    deployment that fits; a JSON-able report."""
    _check_run(tokens_per_gpu, gpus_per_node, rebalance_every, num_batches)
    fit, skipped = deployments(ep_sizes, redundants, routing.num_logical, gpus_per_node)
    weight = routing.counts() if placement_counts is None else placement_counts
    if weight.shape != (routing.num_layers, routing.num_logical):
        raise ValueError(f"placement_counts: shape {tuple(weight.shape)}, the routing has "
                         f"{routing.num_layers} layers of {routing.num_logical} experts")
    results = []
    for dep in fit:
        counts = batch_counts(routing, tokens_per_gpu * dep.ep_size, num_batches)
        placements = {"trivial": trivial(dep, routing.num_layers), "eplb": plan(weight, dep, routing.num_groups)}
        if rebalance_every:
            placements["online"] = online(counts, rebalance_every, placements["trivial"], dep, routing.num_groups)
        for setting, phy2log in placements.items():
            figures = summarize(batch_gpu_loads(counts, phy2log, dep.ep_size), routing.layer_ids)
            results.append({**dep.describe(), "policy": dep.policy(routing.num_groups), "setting": setting,
                            "batches": counts.shape[0], "batch_tokens": tokens_per_gpu * dep.ep_size, **figures})
    return {**_describe(routing), "tokens_per_gpu": tokens_per_gpu, "gpus_per_node": gpus_per_node,
            "rebalance_every": rebalance_every, "results": results, "skipped": skipped}


def drift(a: Routing, b: Routing, steps: list[float], ep_sizes: list[int], redundants: list[int], *,
          rebalance_every: int = 10, tokens_per_gpu: int = 128, gpus_per_node: int = 8,
          num_tokens: int | None = None, num_batches: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Placement planned on ``a``, traffic ``mix(a, b, w)`` for each ``w`` in ``steps``; settings
    ``trivial``, ``stale`` (EPLB on ``a``), ``online`` (starting from ``stale``) and ``ceiling``
    (EPLB on the traffic itself). A JSON-able report."""
    _check_run(tokens_per_gpu, gpus_per_node, rebalance_every, num_batches)
    if not steps or any(not 0 <= w <= 1 for w in steps):
        raise ValueError(f"steps: each w must be in [0, 1], got {steps}")
    fit, skipped = deployments(ep_sizes, redundants, a.num_logical, gpus_per_node)
    a_counts = a.counts()
    stale = {dep: plan(a_counts, dep, a.num_groups) for dep in fit}
    results = []
    for w in steps:
        traffic = mix_routing(a, b, w, num_tokens, seed)
        for dep in fit:
            counts = batch_counts(traffic, tokens_per_gpu * dep.ep_size, num_batches)
            placements = {"trivial": trivial(dep, a.num_layers), "stale": stale[dep],
                          "online": online(counts, rebalance_every, stale[dep], dep, a.num_groups),
                          "ceiling": plan(traffic.counts(), dep, a.num_groups)}
            row = {"w": w, **dep.describe(), "policy": dep.policy(a.num_groups), "batches": counts.shape[0]}
            for setting, phy2log in placements.items():
                figures = summarize(batch_gpu_loads(counts, phy2log, dep.ep_size), traffic.layer_ids)
                row[setting] = {k: v for k, v in figures.items() if k != "per_layer"}
            results.append(row)
    return {"from": _describe(a), "to": _describe(b), "steps": steps, "rebalance_every": rebalance_every,
            "tokens_per_gpu": tokens_per_gpu, "gpus_per_node": gpus_per_node, "results": results,
            "skipped": skipped}


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block, then restored. The simulator's work is
    many mid-sized tensor operations: a second thread barely speeds them up, and on a machine whose
    cores are busy the threads' waits on each other slow them down several times."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_run(tokens_per_gpu: int, gpus_per_node: int, rebalance_every: int | None,
               num_batches: int | None) -> None:
    for name, value in [("tokens_per_gpu", tokens_per_gpu), ("gpus_per_node", gpus_per_node),
                        ("rebalance_every", rebalance_every), ("num_batches", num_batches)]:
        if value is not None and value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")


def _describe(routing: Routing) -> dict[str, Any]:
    return {"source": routing.meta.get("source"), "tokens": routing.num_tokens, "layers": routing.num_layers,
            "layer_ids": list(routing.layer_ids), "num_logical_experts": routing.num_logical,
            "top_k": routing.top_k, "num_groups": routing.num_groups}


# ---- tables and plots --------------------------------------------------------------------------------
def format_simulation(report: dict[str, Any], per_layer: bool = False) -> str:
    lines = [f"{'EP':>4} {'slots':>6} {'nodes':>5} {'policy':<12} {'setting':<12} {'balancedness':>12} "
             f"{'max tok/GPU':>12} {'mean tok/GPU':>12} {'MoE time':>8}"]
    for r in report["results"]:
        lines.append(f"{r['ep_size']:>4} {r['num_physical']:>6} {r['num_nodes']:>5} {r['policy']:<12} "
                     f"{SETTING_NAMES[r['setting']]:<12} {r['balancedness']:>12.4f} {r['max_gpu_tokens']:>12.1f} "
                     f"{r['mean_gpu_tokens']:>12.1f} {r['relative_moe_time']:>7.3f}x")
        if per_layer:
            layers = r["per_layer"]
            for layer, bal, time in zip(layers["layer_ids"], layers["balancedness"], layers["relative_moe_time"]):
                lines.append(f"{'':>4} layer {layer:>3}: balancedness "
                             + ("-" if bal is None else f"{bal:.4f}, MoE time {time:.3f}x"))
    for s in report["skipped"]:
        lines.append(f"skipped EP {s['ep_size']} with {s['num_physical']} slots: {s['reason']}")
    return "\n".join(lines)


def format_drift(report: dict[str, Any]) -> str:
    columns = ("trivial", "stale", "online", "ceiling")
    lines = []
    for dep_rows in _by_deployment(report["results"]).values():
        first = dep_rows[0]
        lines.append(f"EP {first['ep_size']}, {first['num_physical']} slots ({first['num_nodes']} node(s), "
                     f"{first['policy']}), online: every {report['rebalance_every']} batches; balancedness")
        lines.append(f"{'w':>5}  " + "  ".join(f"{SETTING_NAMES[c]:>25}" for c in columns))
        for r in dep_rows:
            lines.append(f"{r['w']:>5.2f}  " + "  ".join(f"{r[c]['balancedness']:>25.4f}" for c in columns))
    for s in report["skipped"]:
        lines.append(f"skipped EP {s['ep_size']} with {s['num_physical']} slots: {s['reason']}")
    return "\n".join(lines)


def _by_deployment(results: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["num_physical"], r["ep_size"]), []).append(r)
    return groups


def plot_simulation(report: dict[str, Any], path: str, title: str = "") -> None:
    """Balancedness against EP size (log axis), one line per setting and redundancy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in report["results"]:
        lines.setdefault((r["setting"], r["redundant"]), []).append((r["ep_size"], r["balancedness"]))
    for (setting, redundant), points in sorted(lines.items(), key=lambda kv: (kv[0][1], kv[0][0] != "trivial")):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", linestyle="--" if setting == "trivial" else "-",
                label=f"{SETTING_NAMES[setting]}, {redundant} redundant")
    sizes = sorted({r["ep_size"] for r in report["results"]})
    ax.set_xscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set(xlabel="EP size (GPUs)", ylabel="balancedness (mean / max tokens per GPU)", ylim=(0, 1.05),
           title=title or f"simulated: {report['source']}, {report['tokens_per_gpu']} tokens per GPU per batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def plot_drift(report: dict[str, Any], path: str, title: str = "") -> None:
    """Balancedness against the share ``w`` of the new traffic, one panel per deployment."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = _by_deployment(report["results"])
    fig = Figure(figsize=(4.5 * max(1, len(groups)), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, rows in zip(fig.subplots(1, max(1, len(groups)), squeeze=False)[0], groups.values()):
        ws = [r["w"] for r in rows]
        for setting in ("trivial", "stale", "online", "ceiling"):
            ax.plot(ws, [r[setting]["balancedness"] for r in rows], marker="o", label=SETTING_NAMES[setting])
        ax.set(xlabel="w (share of traffic from B)", ylabel="balancedness", ylim=(0, 1.05),
               title=f"EP {rows[0]['ep_size']}, {rows[0]['num_physical']} slots")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or f"simulated drift: {report['from']['source']} -> {report['to']['source']}")
    fig.savefig(path, dpi=120)
