"""The two EPLB files: an expert distribution (recorded load) and an expert placement.

Each is one JSON object, or the same dict saved with ``torch.save`` in a file whose name ends in
``.pt`` (where tensors may stand in for the nested lists). Sizes and maps as in ``algorithm.py``.

Expert distribution, what a server dumps and ``moeserve eplb plan`` reads::

    {"format": "moeserve-expert-distribution", "version": 1,
     "mode": "stat" | "per_pass" | "per_token",
     "num_layers": L, "num_logical_experts": E, "num_groups": G,
     "model": "<fingerprint>", "passes": <forward passes recorded>,
     "logical_count": [[tokens routed to each logical expert] x L]}   # [L, E]; dense layers' rows are 0

Expert placement, what ``moeserve eplb plan`` writes and ``--init-expert-location`` reads::

    {"format": "moeserve-expert-placement", "version": 1,
     "num_layers": L, "num_logical_experts": E, "num_physical_experts": P, "ep_size": N,
     "phy2log": [[logical expert of each physical slot] x L]}          # [L, P]

Other keys (``"meta"``, ``"per_pass"``, ...) may be present; readers ignore them. Readers check the
keys that are present against each other and against the tensor; every error is a ValueError that
names the field.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from moeserve.eplb.algorithm import rebalance_experts, trivial_phy2log

DISTRIBUTION_FORMAT = "moeserve-expert-distribution"
PLACEMENT_FORMAT = "moeserve-expert-placement"
VERSION = 1
MODES = ("stat", "per_pass", "per_token")


@dataclass(frozen=True)
class Distribution:
    """A recorded expert load: ``logical_count [L, E]`` (int64 token counts, or float64), the ``G``
    expert groups, and the file's other keys (mode, model, passes, extras) in ``meta``."""

    logical_count: torch.Tensor
    num_groups: int = 1
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.logical_count.shape[0]

    @property
    def num_logical(self) -> int:
        return self.logical_count.shape[1]


def save_distribution(path: str, logical_count: torch.Tensor, *, num_groups: int = 1, mode: str = "stat",
                      model: str = "", passes: int = 0, **extra: Any) -> None:
    """Write ``logical_count [L, E]`` as an expert distribution; ``extra`` keys are stored as given."""
    count = _count_tensor(logical_count, "logical_count")
    obj = {"format": DISTRIBUTION_FORMAT, "version": VERSION, "mode": mode, "num_layers": count.shape[0],
           "num_logical_experts": count.shape[1], "num_groups": num_groups, "model": model, "passes": passes,
           "logical_count": count, **extra}
    _as_distribution(obj, "save_distribution")
    _write(path, obj)


def load_distribution(path: str) -> Distribution:
    """Read an expert distribution file (JSON or ``.pt``)."""
    return _as_distribution(_read(path), path)


def save_placement(path: str, phy2log: torch.Tensor, num_logical: int, ep_size: int,
                   meta: dict[str, Any] | None = None) -> None:
    """Write ``phy2log [L, P]`` as an expert placement for ``ep_size`` EP ranks; ``meta`` (how it was
    planned, say) is stored under ``"meta"``."""
    phy2log = phy2log.to(torch.int64).cpu()
    obj = {"format": PLACEMENT_FORMAT, "version": VERSION, "num_layers": phy2log.shape[0],
           "num_logical_experts": num_logical, "num_physical_experts": phy2log.shape[1], "ep_size": ep_size,
           "phy2log": phy2log}
    if meta:
        obj["meta"] = meta
    _as_placement(obj, "save_placement")
    _write(path, obj)


def load_placement(path: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """Read an expert placement file: ``phy2log [L, P]`` int64 and the file's other keys."""
    return _as_placement(_read(path), path)


def initial_phy2log(spec: str, num_layers: int, num_logical: int, num_physical: int, ep_size: int,
                    num_groups: int, num_nodes: int) -> torch.Tensor:
    """``phy2log [L, P]`` a server starts with, from ``--init-expert-location``: ``trivial``; a
    ``.json`` / ``.pt`` file or an inline JSON object (starting with ``{``) that holds a placement
    (``phy2log``, used as it is) or a distribution (``logical_count``, balanced here by
    ``rebalance_experts`` for these sizes). Raises ValueError naming the field that does not fit
    the model."""
    where = "init_expert_location"
    _require(ep_size >= 1 and num_physical % ep_size == 0, where,
             f"ep_size {ep_size} does not divide the {num_physical} physical slots")
    if spec == "trivial":
        return trivial_phy2log(num_layers, num_logical, num_physical)
    obj = _read_spec(spec, where)
    if "phy2log" in obj:
        return _model_placement(obj, where, num_layers, num_logical, num_physical, ep_size)
    if "logical_count" in obj:
        dist = _as_distribution(obj, where)
        _require(dist.num_layers == num_layers, where,
                 f"logical_count has {dist.num_layers} layers, the model has {num_layers}")
        _require(dist.num_logical == num_logical, where,
                 f"logical_count has {dist.num_logical} logical experts, the model has {num_logical}")
        try:
            return rebalance_experts(dist.logical_count, num_physical, num_groups, num_nodes, ep_size)[0]
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    raise ValueError(f"{where}: holds neither phy2log (a placement) nor logical_count (a distribution)")


def _model_placement(obj: dict[str, Any], where: str, num_layers: int, num_logical: int, num_physical: int,
                     ep_size: int) -> torch.Tensor:
    """The placement's ``phy2log``, checked against the model's sizes first, then on its own."""
    rows, slots = _int_tensor(obj["phy2log"], f"{where}: phy2log").shape
    _require(rows == num_layers, where, f"phy2log has {rows} layers, the model has {num_layers}")
    given = obj.get("num_logical_experts", num_logical)
    _require(given == num_logical, where, f"num_logical_experts is {given!r}, the model has {num_logical}")
    _require(slots == num_physical, where, f"phy2log has {slots} physical slots, the model has {num_physical}")
    given = obj.get("ep_size", ep_size)
    _require(given == ep_size, where, f"ep_size: the placement was planned for ep_size {given!r}, the server "
                                      f"runs {ep_size}")
    return _as_placement(obj, where, num_logical)[0]


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {message}")


def _read_spec(spec: str, where: str) -> dict[str, Any]:
    if spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid inline JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: inline JSON must be an object")
        return obj
    if spec.endswith((".json", ".pt")):
        return _read(spec)
    raise ValueError(f"{where}: expected 'trivial', a .json or .pt file, or an inline JSON object, got {spec!r}")


def _as_distribution(obj: dict[str, Any], where: str) -> Distribution:
    _check_header(obj, where, DISTRIBUTION_FORMAT)
    if "logical_count" not in obj:
        raise ValueError(f"{where}: logical_count: missing")
    count = _count_tensor(obj["logical_count"], f"{where}: logical_count")
    layers, num_logical = count.shape
    _check_key(obj, where, "num_layers", layers, "logical_count has {} rows")
    _check_key(obj, where, "num_logical_experts", num_logical, "logical_count has {} columns")
    num_groups = obj.get("num_groups", 1)
    if not isinstance(num_groups, int) or num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"{where}: num_groups {num_groups!r} does not split the {num_logical} logical experts")
    if obj.get("mode", "stat") not in MODES:
        raise ValueError(f"{where}: mode {obj['mode']!r} is not one of {MODES}")
    meta = {k: v for k, v in obj.items() if k not in ("logical_count", "num_groups")}
    return Distribution(count, num_groups, meta)


def _as_placement(obj: dict[str, Any], where: str,
                  num_logical: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """``phy2log`` and the other keys of a placement, checked against each other (``num_logical``
    stands in for a missing ``num_logical_experts``)."""
    _check_header(obj, where, PLACEMENT_FORMAT)
    if "phy2log" not in obj:
        raise ValueError(f"{where}: phy2log: missing")
    phy2log = _int_tensor(obj["phy2log"], f"{where}: phy2log")
    layers, num_physical = phy2log.shape
    _check_key(obj, where, "num_layers", layers, "phy2log has {} rows")
    _check_key(obj, where, "num_physical_experts", num_physical, "phy2log has {} columns")
    num_logical = obj.get("num_logical_experts", num_logical)
    if not isinstance(num_logical, int) or not 1 <= num_logical <= num_physical:
        raise ValueError(f"{where}: num_logical_experts {num_logical!r} does not fit the {num_physical} physical "
                         f"slots of phy2log")
    ep_size = obj.get("ep_size", 1)
    if not isinstance(ep_size, int) or ep_size < 1 or num_physical % ep_size:
        raise ValueError(f"{where}: ep_size {ep_size!r} does not divide the {num_physical} physical slots")
    _check_experts(phy2log, num_logical, where)
    return phy2log, {k: v for k, v in obj.items() if k != "phy2log"}


def _check_header(obj: Any, where: str, expected: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object (a dict), got {type(obj).__name__}")
    if obj.get("format", expected) != expected:
        raise ValueError(f"{where}: format is {obj['format']!r}, expected {expected!r}")
    if obj.get("version", VERSION) != VERSION:
        raise ValueError(f"{where}: version {obj['version']!r} is not supported (this reads {VERSION})")


def _check_key(obj: dict[str, Any], where: str, key: str, actual: int, what: str) -> None:
    if key in obj and obj[key] != actual:
        raise ValueError(f"{where}: {key} is {obj[key]!r} but {what.format(actual)}")


def _check_experts(phy2log: torch.Tensor, num_logical: int, where: str) -> None:
    bad = (phy2log < 0) | (phy2log >= num_logical)
    if bad.any():
        layer, slot = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{where}: phy2log holds logical expert {int(phy2log[layer, slot])} (layer {layer}, slot "
                         f"{slot}), outside the {num_logical} logical experts")
    present = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.bool)
    present.scatter_(1, phy2log, True)
    if not present.all():
        layer, expert = (int(i) for i in (~present).nonzero()[0])
        raise ValueError(f"{where}: phy2log gives logical expert {expert} no physical slot in layer {layer}")


def _int_tensor(value: Any, name: str) -> torch.Tensor:
    t = _tensor(value, name)
    if t.is_floating_point():
        if not torch.equal(t, t.round()):
            raise ValueError(f"{name}: expected integers")
        t = t.to(torch.int64)
    return t


def _count_tensor(value: Any, name: str) -> torch.Tensor:
    """Token counts ``[L, E]``: int64, or float64 when any is fractional; finite and >= 0."""
    t = _tensor(value, name)
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise ValueError(f"{name}: counts must be finite")
    if (t < 0).any():
        raise ValueError(f"{name}: counts must be >= 0")
    return t


def _tensor(value: Any, name: str) -> torch.Tensor:
    """A ``[rows, columns]`` int64 or float64 CPU tensor of a tensor or nested lists."""
    try:
        t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}: expected a [rows, columns] table of numbers ({exc})") from None
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name}: expected a non-empty [rows, columns] table, got shape {tuple(t.shape)}")
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name}: expected numbers, got {t.dtype}")
    if not isinstance(value, torch.Tensor):  # from lists: int64 unless some value is fractional
        return t.to(torch.int64) if torch.isfinite(t).all() and torch.equal(t, t.round()) else t
    return t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)


def _read(path: str) -> dict[str, Any]:
    """The dict in a ``.pt`` or JSON file; OSError when it cannot be opened, ValueError when it is
    not such a dict."""
    if path.endswith(".pt"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError) as exc:
            raise ValueError(f"{path}: not a readable .pt file ({exc})") from None
    else:
        with open(path, encoding="utf-8") as f:
            try:
                obj = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object (a dict), got {type(obj).__name__}")
    return obj


def _write(path: str, obj: dict[str, Any]) -> None:
    """Write through a temporary file, so that a reader never sees half a file; JSON stores tensors
    as nested lists."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        if path.endswith(".pt"):
            torch.save(obj, tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(obj, f, default=_jsonable)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
