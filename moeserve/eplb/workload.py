"""Expert workloads: which logical experts each token is routed to, per MoE layer, from a recording,
a server's dump or a synthetic model; what ``moeserve eplb simulate`` and ``eplb drift`` replay.

Sizes as in ``algorithm.py`` (``L`` MoE layers, ``E`` logical experts, ``G`` groups), and ``T``
tokens, ``k`` experts per token. A workload is a ``Routing``: ``topk_ids [L, T, k]`` (int16, or
int32 when ``E`` does not fit) and a phase label per token.

A source is named by a string (``load_source``):
- a recorded directory (``moeserve eplb record``; the format below): replayed as recorded;
- a distribution file a server dumped (``/dump_expert_distribution_record``, ``eplb.files``): a
  ``per_token`` dump replays as recorded; a ``stat`` / ``per_pass`` dump holds counts only, so
  tokens are drawn from them: each token takes ``k`` distinct experts, with probability
  proportional to the counts (successive sampling: the first ``k`` distinct of independent draws);
- ``zipf:S`` or ``zipf:S:SEED``: synthetic, expert of popularity rank ``r`` has weight ``r ** -S``,
  an independent random permutation of the experts per layer, ``k`` distinct experts per token
  drawn as above (``S = 0`` is uniform routing);
- ``mix:A,B,w``: each token from ``A`` with probability ``1 - w``, else from ``B`` (token ``i`` of a
  source is its ``i``-th, wrapping around); ``A`` and ``B`` are sources (a nested mix goes in
  brackets: ``mix:[mix:X,Y,0.5],Z,0.1``).

The recorded directory (``save_recording`` / ``load_recording``)::

    DIR/meta.json     {"format": "moeserve-expert-workload", "version": 1, "model": fingerprint,
                       "dataset": ..., "num_prompts": ..., "max_tokens": ...,
                       "layer_ids": [model layer of each of the L rows], "num_layers": model layers,
                       "num_logical_experts": E, "num_groups": G, "top_k": k, "dtype": "int16",
                       "phases": {"prefill": {"tokens": ..., "passes": ...}, "decode": {...}},
                       "passes": forward passes, "tokens": T}
    DIR/prefill.npz   numpy arrays of the prefill tokens: topk_ids [L, T_p, k] (logical expert ids,
                      in the router's order), positions [T_p] int32 (each token's position in its
                      sequence, -1 when unknown), pass_index [T_p] int32 (the forward pass it ran in)
    DIR/decode.npz    the same for decode tokens

Loading merges the phases back into the order the passes ran in.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from moeserve.eplb.files import load_distribution

WORKLOAD_FORMAT = "moeserve-expert-workload"
VERSION = 1
PHASES = ("prefill", "decode", "drawn")  # phase codes 0, 1, 2; "drawn": synthetic or drawn from counts
RECORDED_PHASES = PHASES[:2]
ARRAYS = ("topk_ids", "positions", "pass_index")  # of each phase's .npz
DRAW_CHUNK_ROWS = 1 << 18  # (layer, token) rows sampled at a time: bounds the sampler's memory


@dataclass(frozen=True)
class Routing:
    """``topk_ids [L, T, k]`` logical expert ids, ``phase [T]`` uint8 codes into ``PHASES``; for a
    recording also ``positions [T]`` and ``pass_index [T]`` int32. ``layer_ids``: the model layer of
    each row (``0 … L-1`` for synthetic ones)."""

    topk_ids: torch.Tensor
    phase: torch.Tensor
    num_logical: int
    num_groups: int = 1
    layer_ids: tuple[int, ...] = ()
    positions: torch.Tensor | None = None
    pass_index: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.topk_ids.dim() != 3:
            raise ValueError(f"topk_ids: expected [layers, tokens, k], got shape {tuple(self.topk_ids.shape)}")
        if self.phase.shape != (self.num_tokens,):
            raise ValueError(f"phase: expected [{self.num_tokens}] labels, got shape {tuple(self.phase.shape)}")
        if self.num_logical < 1 or self.num_groups < 1 or self.num_logical % self.num_groups:
            raise ValueError(f"num_groups: {self.num_groups} does not split {self.num_logical} logical experts")
        if not self.layer_ids:
            object.__setattr__(self, "layer_ids", tuple(range(self.num_layers)))
        if len(self.layer_ids) != self.num_layers:
            raise ValueError(f"layer_ids: {len(self.layer_ids)} ids for {self.num_layers} layers")

    @property
    def num_layers(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[2]

    def counts(self) -> torch.Tensor:
        """``[L, E]`` int64: tokens routed to each logical expert."""
        return torch.stack([torch.bincount(ids.flatten().long(), minlength=self.num_logical)
                            for ids in self.topk_ids])

    def take(self, index: torch.Tensor) -> Routing:
        """The tokens at ``index [T']`` (int64), in that order."""
        return replace(self, topk_ids=self.topk_ids[:, index], phase=self.phase[index],
                       positions=None if self.positions is None else self.positions[index],
                       pass_index=None if self.pass_index is None else self.pass_index[index])

    def only(self, phase: str) -> Routing:
        """The tokens of one phase (``"all"``: every token)."""
        if phase == "all":
            return self
        if phase not in PHASES:
            raise ValueError(f"phase: expected all or one of {PHASES}, got {phase!r}")
        return self.take((self.phase == PHASES.index(phase)).nonzero().flatten())


@dataclass(frozen=True)
class SourceOptions:
    """Sizes of synthetic sources (DeepSeek-V3's by default) and how many tokens to draw.
    ``top_k`` None: 8 for zipf; a counts-only dump needs it given (it does not record ``k``).
    ``num_tokens`` None: 100,000 for zipf, the recorded tokens for a dump or a recording, the longer
    of the two for a mix; given, a recording is cut or wrapped around to it."""

    num_experts: int = 256
    top_k: int | None = None
    num_layers: int = 58
    num_groups: int = 8
    num_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_layers", "num_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.top_k is not None and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k: must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.num_tokens is not None and self.num_tokens < 1:
            raise ValueError(f"num_tokens: must be >= 1, got {self.num_tokens}")


def load_source(spec: str, options: SourceOptions | None = None) -> Routing:
    """The routing a source string names (see the module docstring)."""
    options = options or SourceOptions()
    if spec.startswith("zipf:"):
        return zipf_routing(*_zipf_args(spec, options.seed), options)
    if spec.startswith("mix:"):
        a, b, w = _mix_args(spec)
        return mix_routing(load_source(a, options), load_source(b, options), w, options.num_tokens, options.seed)
    if os.path.isdir(spec):
        return _resized(load_recording(spec), options.num_tokens)
    if os.path.isfile(spec):
        return _dump_routing(spec, options)
    raise ValueError(f"{spec!r}: not a recorded directory, a distribution file, zipf:S[:SEED] or mix:A,B,w")


def _zipf_args(spec: str, default_seed: int) -> tuple[float, int]:
    parts = spec.split(":")[1:]
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        exponent = float(parts[0])
        seed = int(parts[1]) if len(parts) == 2 else default_seed
    except ValueError:
        raise ValueError(f"{spec!r}: expected zipf:S or zipf:S:SEED (S a number >= 0, SEED an integer)") from None
    if not (math.isfinite(exponent) and exponent >= 0):
        raise ValueError(f"{spec!r}: the Zipf exponent must be a finite number >= 0")
    return exponent, seed


def _mix_args(spec: str) -> tuple[str, str, float]:
    """``mix:A,B,w`` split at its top-level commas (brackets nest)."""
    body, depth, parts, start = spec[len("mix:"):], 0, [], 0
    for i, ch in enumerate(body):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    try:
        if len(parts) != 3 or not parts[0] or not parts[1]:
            raise ValueError
        w = float(parts[2])
    except ValueError:
        raise ValueError(f"{spec!r}: expected mix:A,B,w (a nested mix in brackets)") from None
    if not 0 <= w <= 1:
        raise ValueError(f"{spec!r}: the weight w of B must be in [0, 1], got {w}")
    return _unbracket(parts[0]), _unbracket(parts[1]), w


def _unbracket(part: str) -> str:
    return part[1:-1] if part.startswith("[") and part.endswith("]") else part


# ---- synthetic and drawn routing ----------------------------------------------------------------
def zipf_weights(exponent: float, num_layers: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """``[L, E]`` float64 routing probabilities: Zipf over popularity ranks, an independent random
    permutation of the experts per layer (``weight[l, perm[l, r]] = (r + 1) ** -S`` normalized)."""
    by_rank = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -exponent
    by_rank /= by_rank.sum()
    weight = torch.empty(num_layers, num_experts, dtype=torch.float64)
    for layer in range(num_layers):
        weight[layer, torch.randperm(num_experts, generator=gen)] = by_rank
    return weight


def zipf_routing(exponent: float, seed: int, options: SourceOptions) -> Routing:
    """``zipf:S:SEED``: ``num_tokens`` tokens (100,000 by default) of ``top_k`` (8) distinct experts."""
    if options.num_experts % options.num_groups:
        raise ValueError(f"num_groups: {options.num_groups} does not split {options.num_experts} experts")
    top_k = options.top_k or min(8, options.num_experts)
    gen = torch.Generator().manual_seed(seed)
    weight = zipf_weights(exponent, options.num_layers, options.num_experts, gen)
    ids = sample_distinct(weight, options.num_tokens or 100_000, top_k, gen)
    return _drawn(ids, options.num_experts, options.num_groups, (), {"source": f"zipf:{exponent:g}:{seed}"})


def counts_routing(count: torch.Tensor, num_tokens: int, top_k: int, seed: int, num_groups: int = 1,
                   layer_ids: tuple[int, ...] = (), meta: dict[str, Any] | None = None) -> Routing:
    """Tokens drawn from recorded ``count [L, E]``: ``top_k`` distinct experts each, with probability
    proportional to the counts."""
    weight = count.to(torch.float64)
    ids = sample_distinct(weight / weight.sum(-1, keepdim=True), num_tokens, top_k, torch.Generator().manual_seed(seed))
    return _drawn(ids, count.shape[1], num_groups, layer_ids, meta or {})


def _drawn(ids: torch.Tensor, num_logical: int, num_groups: int, layer_ids: tuple[int, ...],
           meta: dict[str, Any]) -> Routing:
    phase = torch.full((ids.shape[1],), PHASES.index("drawn"), dtype=torch.uint8)
    return Routing(ids.to(_id_dtype(num_logical)), phase, num_logical, num_groups, layer_ids, meta=meta)


def sample_distinct(weight: torch.Tensor, num_tokens: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[L, T, k]`` int64: per layer and token, ``k`` distinct experts by successive sampling from
    ``weight [L, E]`` (each next expert drawn in proportion to ``weight`` among those not yet
    taken; the draws are Walker alias draws, a taken expert is drawn again). Raises ValueError
    when a layer has fewer than ``k`` experts with weight."""
    layers, num_experts = weight.shape
    short = ((weight > 0).sum(-1) < k).nonzero().flatten().tolist()
    if short:
        raise ValueError(f"top_k: layer row {short[0]} routes to fewer than {k} distinct experts, so tokens of "
                         f"{k} distinct experts cannot be drawn from it")
    prob, alias = _alias_tables(weight)  # [L * E] each
    out = torch.empty(layers, num_tokens, k, dtype=torch.int64)
    chunk = max(1, DRAW_CHUNK_ROWS // layers)
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        base = torch.arange(layers).repeat_interleave(n) * num_experts  # [L * n]
        out[:, start:start + n] = _draw_rows(base, prob, alias, weight, k, gen).view(layers, n, k)
    return out


def _draw_rows(base: torch.Tensor, prob: torch.Tensor, alias: torch.Tensor, weight: torch.Tensor, k: int,
               gen: torch.Generator) -> torch.Tensor:
    """``[R, k]`` distinct experts for rows whose layer's alias table starts at ``base [R]``."""
    num_experts = weight.shape[1]
    picked = torch.empty(k, base.shape[0], dtype=torch.int64)  # [k, R]: a slot's row is contiguous
    for slot in range(k):
        picked[slot] = _alias_draw(base, prob, alias, num_experts, gen)
        pending = (picked[:slot] == picked[slot]).any(0).nonzero().flatten()
        for _ in range(16):  # draw again where the expert was taken: few, unless the load is very skewed
            if not pending.numel():
                break
            expert = _alias_draw(base.index_select(0, pending), prob, alias, num_experts, gen)
            taken = (picked[:slot].index_select(1, pending) == expert).any(0)
            picked[slot].index_copy_(0, pending[~taken], expert[~taken])
            pending = pending[taken]
        if pending.numel():  # the rest by an exact draw among the experts not taken
            w = weight.index_select(0, base.index_select(0, pending) // num_experts)
            w.scatter_(1, picked[:slot].index_select(1, pending).t(), 0.0)
            picked[slot].index_copy_(0, pending, torch.multinomial(w, 1, generator=gen).flatten())
    return picked.t()


def _alias_draw(base: torch.Tensor, prob: torch.Tensor, alias: torch.Tensor, num_experts: int,
                gen: torch.Generator) -> torch.Tensor:
    """One draw per row from the alias table starting at ``base [R]``."""
    at = base + torch.randint(num_experts, base.shape, generator=gen)
    keep = torch.rand(base.shape, generator=gen) < prob.take(at)
    return torch.where(keep, at - base, alias.take(at))


def _alias_tables(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Walker's alias tables of each row of ``weight [L, E]`` (Vose's construction), flattened to
    ``[L * E]``: draw ``i`` uniform, keep it with probability ``prob[i]``, else take ``alias[i]``."""
    layers, n = weight.shape
    prob, alias = torch.ones(layers, n, dtype=torch.float64), torch.arange(n).repeat(layers, 1)
    for layer, row in enumerate((weight / weight.sum(-1, keepdim=True) * n).tolist()):
        small = [i for i, x in enumerate(row) if x < 1.0]
        large = [i for i, x in enumerate(row) if x >= 1.0]
        while small and large:
            s, g = small.pop(), large.pop()
            prob[layer, s], alias[layer, s] = row[s], g
            row[g] -= 1.0 - row[s]
            (small if row[g] < 1.0 else large).append(g)
    # rounding can leave an item without weight unpaired (kept with probability 1): never draw it
    stray = (weight == 0) & (prob == 1)
    alias = torch.where(stray, weight.argmax(-1, keepdim=True), alias)
    prob = prob.masked_fill(stray, 0.0)
    return prob.flatten().to(torch.float32), alias.flatten()


def mix_routing(a: Routing, b: Routing, w: float, num_tokens: int | None = None, seed: int = 0) -> Routing:
    """Token ``i`` is ``b``'s ``i``-th with probability ``w``, else ``a``'s (each wrapping around);
    ``num_tokens`` defaults to the longer of the two."""
    if (a.num_layers, a.num_logical, a.top_k) != (b.num_layers, b.num_logical, b.top_k):
        raise ValueError(f"mix: the sources differ in size: {a.num_layers} layers, {a.num_logical} experts, top "
                         f"{a.top_k} against {b.num_layers}, {b.num_logical}, top {b.top_k}")
    n = num_tokens or max(a.num_tokens, b.num_tokens)
    gen = torch.Generator().manual_seed(seed + 0x5EED)
    from_b = torch.rand(n, generator=gen, dtype=torch.float64) < w  # [T]
    index = torch.arange(n)
    ids_a, ids_b = a.topk_ids[:, index % a.num_tokens], b.topk_ids[:, index % b.num_tokens]
    ids = torch.where(from_b.view(1, n, 1), ids_b.to(ids_a.dtype), ids_a)  # [L, T, k]
    phase = torch.where(from_b, b.phase[index % b.num_tokens], a.phase[index % a.num_tokens])
    meta = {"source": "mix", "a": a.meta.get("source"), "b": b.meta.get("source"), "w": w,
            "from_b": int(from_b.sum())}
    return Routing(ids, phase, a.num_logical, a.num_groups, a.layer_ids, meta=meta)


def _resized(routing: Routing, num_tokens: int | None) -> Routing:
    if num_tokens is None or num_tokens == routing.num_tokens:
        return routing
    return routing.take(torch.arange(num_tokens) % routing.num_tokens)


# ---- server dumps ------------------------------------------------------------------------------------
def _dump_routing(path: str, options: SourceOptions) -> Routing:
    dist = load_distribution(path)
    meta = {"source": path, "model": dist.meta.get("model", ""), "mode": dist.meta.get("mode")}
    if dist.meta.get("per_token"):
        return _resized(routing_from_per_token(dist.meta["per_token"], dist.num_logical, dist.num_groups, meta),
                        options.num_tokens)
    loaded = (dist.logical_count.sum(1) > 0).nonzero().flatten()
    if not loaded.numel():
        raise ValueError(f"{path}: logical_count: no layer has any load")
    if options.top_k is None:
        raise ValueError(f"{path}: a counts-only ({dist.meta.get('mode', 'stat')}) dump does not record the "
                         f"experts per token: give --top-k")
    count = dist.logical_count[loaded]
    num_tokens = options.num_tokens or max(1, round(float(count[0].sum()) / options.top_k))
    return counts_routing(count, num_tokens, options.top_k, options.seed, dist.num_groups,
                          tuple(loaded.tolist()), meta)


def routing_from_per_token(passes: list[dict[str, Any]], num_logical: int, num_groups: int,
                           meta: dict[str, Any] | None = None) -> Routing:
    """The routing of a ``per_token`` dump's passes (``{"phase", "topk_ids": {str(layer): [T, k]},
    "positions": [T] | None}``), in the order they ran. Rows past ``positions`` (the padding of a
    CUDA graph's bucket) are left out."""
    layer_ids = sorted({int(layer) for p in passes for layer in p["topk_ids"]})
    if not layer_ids:
        raise ValueError("per_token: no forward pass routed any token (was anything generated?)")
    ids, phase, positions, pass_index = [], [], [], []
    for i, p in enumerate(passes):
        if not p["topk_ids"]:
            continue
        if p["phase"] not in RECORDED_PHASES:
            raise ValueError(f"per_token: pass {i}: phase {p['phase']!r} is not one of {RECORDED_PHASES}")
        if sorted(int(layer) for layer in p["topk_ids"]) != layer_ids:
            raise ValueError(f"per_token: pass {i} records layers {sorted(p['topk_ids'])}, others {layer_ids}")
        rows = min(t.shape[0] for t in p["topk_ids"].values())
        if p.get("positions") is not None:
            rows = min(rows, p["positions"].shape[0])
        ids.append(torch.stack([torch.as_tensor(p["topk_ids"][str(layer)])[:rows] for layer in layer_ids]))
        phase.append(torch.full((rows,), RECORDED_PHASES.index(p["phase"]), dtype=torch.uint8))
        pos = p.get("positions")
        positions.append(torch.full((rows,), -1, dtype=torch.int32) if pos is None else pos[:rows].to(torch.int32))
        pass_index.append(torch.full((rows,), i, dtype=torch.int32))
    return Routing(torch.cat(ids, 1).to(_id_dtype(num_logical)), torch.cat(phase), num_logical, num_groups,
                   tuple(layer_ids), torch.cat(positions), torch.cat(pass_index), meta or {})


def _id_dtype(num_logical: int) -> torch.dtype:
    return torch.int16 if num_logical <= torch.iinfo(torch.int16).max else torch.int32


# ---- the recorded directory -----------------------------------------------------------------------
def save_recording(directory: str, routing: Routing, **meta: Any) -> dict[str, Any]:
    """Write ``routing`` as a recorded directory (the module docstring's format); ``meta`` (model,
    dataset, …) goes into ``meta.json``, which is returned."""
    os.makedirs(directory, exist_ok=True)
    positions = routing.positions if routing.positions is not None else torch.full((routing.num_tokens,), -1)
    pass_index = routing.pass_index if routing.pass_index is not None else torch.arange(routing.num_tokens)
    phases = {}
    for code, name in enumerate(RECORDED_PHASES):
        sel = (routing.phase == code).nonzero().flatten()
        np.savez(os.path.join(directory, f"{name}.npz"), topk_ids=routing.topk_ids[:, sel].numpy(),
                 positions=positions[sel].to(torch.int32).numpy(), pass_index=pass_index[sel].to(torch.int32).numpy())
        phases[name] = {"tokens": int(sel.numel()), "passes": int(pass_index[sel].unique().numel())}
    if sum(p["tokens"] for p in phases.values()) != routing.num_tokens:
        raise ValueError("phase: a recorded directory holds prefill and decode tokens only")
    info = {"format": WORKLOAD_FORMAT, "version": VERSION, **meta, "layer_ids": list(routing.layer_ids),
            "num_logical_experts": routing.num_logical, "num_groups": routing.num_groups, "top_k": routing.top_k,
            "dtype": str(routing.topk_ids.dtype).removeprefix("torch."), "phases": phases,
            "passes": int(pass_index.unique().numel()), "tokens": routing.num_tokens}
    with open(os.path.join(directory, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return info


def load_recording(directory: str) -> Routing:
    """A recorded directory's routing, its phases merged back into the order the passes ran in."""
    try:
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{directory}: meta.json: not readable ({exc})") from None
    if info.get("format") != WORKLOAD_FORMAT or info.get("version") != VERSION:
        raise ValueError(f"{directory}: meta.json: not a {WORKLOAD_FORMAT} version {VERSION} directory")
    parts = []
    for code, name in enumerate(RECORDED_PHASES):
        with np.load(os.path.join(directory, f"{name}.npz")) as arrays:
            parts.append((code, {key: torch.from_numpy(arrays[key]) for key in ARRAYS}))
    ids = torch.cat([p["topk_ids"] for _, p in parts], 1)
    if ids.shape[0] != len(info["layer_ids"]) or ids.shape[1] == 0:
        raise ValueError(f"{directory}: topk_ids: shape {tuple(ids.shape)} does not fit layer_ids {info['layer_ids']}")
    phase = torch.cat([torch.full((p["pass_index"].shape[0],), code, dtype=torch.uint8) for code, p in parts])
    pass_index = torch.cat([p["pass_index"] for _, p in parts])
    order = pass_index.argsort(stable=True)
    routing = Routing(ids, phase, info["num_logical_experts"], info.get("num_groups", 1), tuple(info["layer_ids"]),
                      torch.cat([p["positions"] for _, p in parts]), pass_index, {"source": directory, **info})
    return routing.take(order)


# ---- prompts ---------------------------------------------------------------------------------------
def read_prompts(path: str) -> list[str | list[dict[str, str]]]:
    """Prompts of a file: a JSONL file (``.jsonl``) holds one per line, a string or an object with
    ``prompt`` / ``text`` (a string) or ``messages`` (a chat); any other file one prompt per
    non-empty line."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    if not path.endswith(".jsonl"):
        return [line for line in lines if line.strip()]
    prompts: list[str | list[dict[str, str]]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc})") from None
        prompt = obj
        if isinstance(obj, dict):
            prompt = obj.get("messages") or obj.get("prompt") or obj.get("text")
        if not prompt or not isinstance(prompt, (str, list)):
            raise ValueError(f"{path}:{number}: expected a string or an object with prompt, text or messages")
        prompts.append(prompt)
    return prompts


def prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]], chat: bool = True) -> list[int]:
    """Token ids of a prompt: a chat, or a text as one user turn, through ``tokenizer``'s chat
    template (``models.tokenizer.Tokenizer``); a text as it is when ``chat`` is off or the
    tokenizer has no template."""
    if tokenizer is None:
        raise ValueError("the model folder has no tokenizer, so text prompts cannot be encoded")
    if isinstance(prompt, str) and not chat:
        return tokenizer.encode(prompt)
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except ValueError:  # no chat template
        if isinstance(prompt, list):
            raise
        return tokenizer.encode(prompt)
