"""Roles: where a request goes at each point of its life. The scheduler asks its role when a
request arrives, once per step (``poll``), after each prefill chunk and after the prefill, at
the end of the step (``end_step``), and when a request is aborted. ``MixedRole`` is the
monolithic server; the prefill and decode roles of disaggregated serving live in
``moeserve.disagg``."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from moeserve.core import Req
from moeserve.scheduler.requests import cache_prefix

if TYPE_CHECKING:
    from moeserve.scheduler.scheduler import Scheduler


class Role(ABC):
    """The defaults are the monolithic behaviour except for ``after_prefill``."""

    name = "role"
    caches_prefixes = True  # whether a prefix cache serves this role (a decode server receives its KV)

    def bind(self, sched: Scheduler) -> None:
        self.sched = sched

    def validate(self, req: Req) -> None:
        """Raise ValueError naming the problem when this role cannot serve ``req``."""

    def admit(self, req: Req) -> None:
        """A new request: its prompt waits for prefill."""
        self.sched.prefill.add(req)

    def poll(self) -> list[Req]:
        """Move requests along before the step is scheduled (PD: bootstrap, transfers); the
        requests with news for their client (a first token, a finish)."""
        return []

    def after_chunk(self, req: Req, start: int, end: int) -> None:
        """Tokens ``start:end`` of ``req`` are in the cache now."""

    @abstractmethod
    def after_prefill(self, req: Req) -> bool:
        """``req`` finished its prefill and sampled its first token; True when the scheduler should
        check its stop conditions (it decodes on here)."""

    def end_step(self) -> None:
        """The step's forward passes are done (speculative decoding's MTP passes run after the
        model's: PD pushes a chunk's KV only now)."""

    def stage(self, req: Req) -> str | None:
        """The name of the role's queue that holds ``req``, if one does (for the abort counters)."""
        return None

    def release(self, req: Req) -> bool:
        """``req`` is aborted: drop what the role holds of it. True when the role keeps its pages
        to free them itself later (a transfer may still be touching them)."""
        return False

    @property
    def num_pending(self) -> int:
        """Requests only the role holds (waiting for a peer or a transfer)."""
        return 0

    def stats(self) -> dict[str, int]:
        """Requests per queue of the role, for metrics."""
        return {}

    def transfer_stats(self) -> object | None:
        """A PD role's ``TransferStats`` (transfers by result, bytes, seconds, writes)."""
        return None

    def close(self) -> None:
        """The rank is stopping."""


# The roles a rank can take, by ``--disaggregation-mode``: "module:function" building one from
# (config, groups, runner), imported only when a rank takes it (the PD roles live above the
# scheduler, in moeserve.disagg).
ROLE_FACTORIES = {"prefill": "moeserve.disagg.rank:prefill_role", "decode": "moeserve.disagg.rank:decode_role"}


def make_role(mode: str, *args: object) -> Role:
    if mode == "null":
        return MixedRole()
    module, name = ROLE_FACTORIES[mode].split(":")
    return getattr(importlib.import_module(module), name)(*args)


class MixedRole(Role):
    """One server does both: after its prefill a request joins the running decode batch."""

    name = "mixed"

    def after_prefill(self, req: Req) -> bool:
        cache_prefix(self.sched.pages, req)  # requests arriving while it decodes share its prompt
        self.sched.decode.add(req)
        return True
