"""What a rank of a prefill or decode server adds to the rank loop: its role and KV transfers."""

from __future__ import annotations

import os

import torch

from moeserve.config import EngineConfig
from moeserve.disagg.roles import DecodeRole, PrefillRole
from moeserve.disagg.secret import read_secret
from moeserve.disagg.transfer.decode import DecodeTransfer
from moeserve.disagg.transfer.loop import Deadlines, KVArgs
from moeserve.disagg.transfer.prefill import PrefillTransfer
from moeserve.disagg.transfer.protocol import AUX_WIDTH, RankIdentity
from moeserve.distributed.groups import ParallelGroups
from moeserve.executor.model_runner import ModelRunner
from moeserve.models.checkpoint import model_fingerprint

FAILURE_PROB_ENV = "MOESERVE_TEST_DISAGG_FAILURE_PROB"


def prefill_role(config: EngineConfig, groups: ParallelGroups, runner: ModelRunner) -> PrefillRole:
    d = config.disagg
    transfer = PrefillTransfer(_kv_args(config, groups, runner, (d.bootstrap_host, d.disaggregation_bootstrap_port)))
    return PrefillRole(transfer, transfer.args.aux.shape[0])


def decode_role(config: EngineConfig, groups: ParallelGroups, runner: ModelRunner) -> DecodeRole:
    transfer = DecodeTransfer(_kv_args(config, groups, runner, None))
    return DecodeRole(transfer, transfer.args.aux.shape[0])


def _aux_slots(config: EngineConfig) -> int:
    """Room for the first-token records of every request that can be in flight at once."""
    return 4 * config.scheduler.max_running_requests


def _kv_args(config: EngineConfig, groups: ParallelGroups, runner: ModelRunner,
             bootstrap: tuple[str, int] | None) -> KVArgs:
    """What the rank's transfers work with; ``bootstrap``: a prefill rank's own bootstrap server."""
    d = config.disagg
    kv = runner.kv_pool.buffer
    aux = torch.zeros(_aux_slots(config), AUX_WIDTH, dtype=torch.float64, device=kv.device)
    identity = RankIdentity(page_size=runner.page_size, kv_dtype=str(kv.dtype).removeprefix("torch."),
                            num_layers=kv.shape[0], model=model_fingerprint(config), num_drafts=config.spec.num_drafts,
                            dp_rank=groups.dp_rank, tp_rank=groups.attn_tp.rank, attn_tp_size=groups.attn_tp.size,
                            attn_dp_size=groups.dp_size)
    deadlines = Deadlines(d.disaggregation_bootstrap_timeout, d.disaggregation_waiting_timeout,
                          d.disaggregation_transfer_timeout, d.disaggregation_heartbeat_interval,
                          d.disaggregation_heartbeat_max_failures)
    return KVArgs(d.disaggregation_transfer_backend, kv, aux, identity, d.disaggregation_host,
                  read_secret(d.secret_path), d.disaggregation_ib_device, bootstrap, deadlines, failure_prob())


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
