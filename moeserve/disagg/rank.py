"""What a rank of a prefill or decode server adds to the rank loop: its role and transfer manager."""

from __future__ import annotations

import os

import torch

from moeserve.config import EngineConfig
from moeserve.disagg.roles import AUX_WIDTH, DecodeRole, PrefillRole
from moeserve.disagg.secret import read_secret
from moeserve.disagg.transfer.manager import Deadlines, KVArgs, KVManager, RankIdentity
from moeserve.distributed.groups import ParallelGroups
from moeserve.executor.model_runner import ModelRunner
from moeserve.models.checkpoint import model_fingerprint

FAILURE_PROB_ENV = "MOESERVE_TEST_DISAGG_FAILURE_PROB"


def prefill_role(config: EngineConfig, groups: ParallelGroups, runner: ModelRunner) -> PrefillRole:
    manager = _manager("prefill", config, groups, runner)
    return PrefillRole(manager, manager.args.aux.shape[0])


def decode_role(config: EngineConfig, groups: ParallelGroups, runner: ModelRunner) -> DecodeRole:
    manager = _manager("decode", config, groups, runner)
    return DecodeRole(manager, manager.args.aux.shape[0])


def _aux_slots(config: EngineConfig) -> int:
    """Room for the first-token records of every request that can be in flight at once."""
    return 4 * config.scheduler.max_running_requests


def _manager(role: str, config: EngineConfig, groups: ParallelGroups, runner: ModelRunner) -> KVManager:
    d = config.disagg
    kv = runner.kv_pool.buffer
    aux = torch.zeros(_aux_slots(config), AUX_WIDTH, dtype=torch.float64, device=kv.device)
    identity = RankIdentity(page_size=runner.page_size, kv_dtype=str(kv.dtype).removeprefix("torch."),
                            num_layers=kv.shape[0], model=model_fingerprint(config), num_drafts=config.spec.num_drafts,
                            dp_rank=groups.dp_rank, tp_rank=groups.attn_tp.rank, attn_tp_size=groups.attn_tp.size,
                            attn_dp_size=groups.dp_size)
    bootstrap = (d.bootstrap_host, d.disaggregation_bootstrap_port) if role == "prefill" else None
    deadlines = Deadlines(d.disaggregation_bootstrap_timeout, d.disaggregation_waiting_timeout,
                          d.disaggregation_transfer_timeout, d.disaggregation_heartbeat_interval,
                          d.disaggregation_heartbeat_max_failures)
    args = KVArgs(d.disaggregation_transfer_backend, kv, aux, identity, d.disaggregation_host,
                  read_secret(d.secret_path), d.disaggregation_ib_device, bootstrap, deadlines, failure_prob())
    return KVManager(role, args)


def failure_prob() -> float:
    """``MOESERVE_TEST_DISAGG_FAILURE_PROB``: tests make transfer polls of this server fail with this
    probability, drawn once per state a transfer is polled in (the PD failure paths, on purpose)."""
    raw = os.environ.get(FAILURE_PROB_ENV, "0")
    try:
        p = float(raw)
    except ValueError:
        raise ValueError(f"{FAILURE_PROB_ENV} must be a probability, got {raw!r}") from None
    if not 0 <= p <= 1:
        raise ValueError(f"{FAILURE_PROB_ENV} must be in [0, 1], got {p}")
    return p
