"""A decode rank's watch over the prefill servers it has rooms with."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import httpx

from moeserve.disagg.transfer.protocol import LOOKUP_TIMEOUT_S, Address, bootstrap_url

if TYPE_CHECKING:
    from moeserve.disagg.transfer.decode import DecodeTransfer

HEARTBEAT_MIN_TIMEOUT_S = 2.0


class Heartbeat:
    """``GET /health`` of each watched prefill server's bootstrap server every
    ``heartbeat_interval``. A server that misses ``heartbeat_max_failures`` checks in a row, or
    answers with another instance id than the one the rank shook hands with (it restarted), is
    gone: the rank's ``DecodeTransfer`` fails exactly its rooms. Its own thread, so that a server
    that does not answer never delays a transfer; it only reads the transfer's rooms and queues
    the verdict."""

    def __init__(self, transfer: DecodeTransfer) -> None:
        self.transfer = transfer
        self.misses: dict[Address, int] = {}
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        limits = self.transfer.args.deadlines
        # a slow answer is not a missed one: a loaded prefill server gets seconds, however often it is asked
        timeout = min(max(limits.heartbeat_interval, HEARTBEAT_MIN_TIMEOUT_S), LOOKUP_TIMEOUT_S)
        with httpx.Client(timeout=timeout, trust_env=False) as http:
            while not self.transfer.loop.stopped(limits.heartbeat_interval):
                self._beat(http, limits.heartbeat_max_failures)

    def _beat(self, http: httpx.Client, max_failures: int) -> None:
        watched = self.transfer.watched()
        self.misses = {a: n for a, n in self.misses.items() if a in watched}
        for bootstrap in watched:
            why = self._check(http, bootstrap, max_failures)
            if why is not None:
                self.misses.pop(bootstrap, None)
                self.transfer.prefill_gone(bootstrap, why)

    def _check(self, http: httpx.Client, bootstrap: Address, max_failures: int) -> str | None:
        """Why the server at ``bootstrap`` counts as gone, or None while it is fine."""
        try:
            r = http.get(f"{bootstrap_url(*bootstrap)}/health")
            instance = r.json().get("instance") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            instance = None
        if instance is None:
            self.misses[bootstrap] = self.misses.get(bootstrap, 0) + 1
            if self.misses[bootstrap] >= max_failures:
                return f"missed {max_failures} health checks in a row"
            return None
        self.misses.pop(bootstrap, None)
        known = self.transfer.layout_instance(bootstrap)
        return "restarted" if known is not None and known != instance else None

    def join(self) -> None:
        self._thread.join(timeout=5)
