"""Prometheus metrics of the API process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moeserve.scheduler.io import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)


class Metrics:
    """One registry per server, so several servers in one process (tests) do not collide."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=reg)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=_LATENCY_BUCKETS, registry=reg)

        self.num_running = gauge("moeserve:num_running_reqs", "requests being prefilled or decoded").labels(**labels)
        self.num_queued = gauge("moeserve:num_queue_reqs", "requests waiting in the engine queue").labels(**labels)
        self.pages_used = gauge("moeserve:kv_pages_used", "KV cache pages in use").labels(**labels)
        self.pages_total = gauge("moeserve:kv_pages_total", "KV cache pages in all").labels(**labels)
        self.pages_cached = gauge("moeserve:kv_pages_cached", "KV cache pages the prefix cache holds (those no "
                                  "request uses are free to evict, not in use)").labels(**labels)
        self.prefix_hit_tokens = gauge("moeserve:prefix_cache_hit_tokens", "prompt tokens whose KV came from the "
                                       "prefix cache").labels(**labels)
        self.prefix_prompt_tokens = gauge("moeserve:prefix_cache_prompt_tokens", "prompt tokens of requests whose "
                                          "prefill started (the hit rate's denominator)").labels(**labels)
        self.spec_verified = gauge("moeserve:spec_verify_seqs", "speculative decoding: a request's verify steps, "
                                   "summed over requests").labels(**labels)
        self.spec_emitted = gauge("moeserve:spec_emitted_tokens", "tokens those verify steps appended").labels(
            **labels)
        self.spec_accept_length = gauge("moeserve:spec_accept_length", "mean tokens a request gains per verify "
                                        "step (1 + accepted drafts)").labels(**labels)
        self.prefix_hit_rate = gauge("moeserve:prefix_cache_hit_rate", "hit tokens / prompt tokens since the "
                                     "start").labels(**labels)
        self.prompt_tokens = Counter("moeserve:prompt_tokens", "prompt tokens received", list(labels),
                                     registry=reg).labels(**labels)
        self.generation_tokens = Counter("moeserve:generation_tokens", "tokens generated", list(labels),
                                         registry=reg).labels(**labels)
        self.requests = Counter("moeserve:requests", "finished requests", [*labels, "finish_reason"], registry=reg)
        self.ttft = histogram("moeserve:time_to_first_token_seconds", "time to first token").labels(**labels)
        self.itl = histogram("moeserve:inter_token_latency_seconds", "time between tokens").labels(**labels)
        self.e2e = histogram("moeserve:e2e_request_latency_seconds", "request latency").labels(**labels)
        self.rejected_messages = Counter("moeserve:rejected_messages", "malformed messages dropped by the API "
                                         "process's engine channel", list(labels), registry=reg).labels(**labels)
        self.engine_rejected_messages = gauge("moeserve:engine_rejected_messages",
                                              "malformed messages dropped by the engine ranks").labels(**labels)
        self.refused_peers = gauge("moeserve:refused_peers",
                                   "ZMQ peers refused at the handshake (unknown key)").labels(**labels)
        self.refused_requests = Counter("moeserve:refused_requests", "HTTP requests refused before reaching the "
                                        "engine", [*labels, "reason"], registry=reg)
        self.pd_queue = Gauge("moeserve:pd_queue_reqs", "requests per queue of a prefill or decode server",
                              [*labels, "queue"], registry=reg)
        self.transfers = Gauge("moeserve:kv_transfers", "finished KV transfers (rooms) by result",
                               [*labels, "result"], registry=reg)
        self.transfer_bytes = gauge("moeserve:kv_transfer_bytes", "bytes of KV sent").labels(**labels)
        self.transfer_seconds = gauge("moeserve:kv_transfer_seconds", "time KV writes took, summed").labels(**labels)
        self.transfer_writes = gauge("moeserve:kv_transfer_writes", "KV writes (one per chunk and peer)").labels(
            **labels)
        self.prefill_peers_lost = gauge("moeserve:pd_prefill_peers_lost", "prefill servers the decode side's "
                                        "heartbeat found dead or restarted").labels(**labels)
        self.ended_early = Gauge("moeserve:requests_ended_early", "requests aborted or failed in the engine, by the "
                                 "stage they were at", [*labels, "stage"], registry=reg)
        self.expert_balancedness = gauge("moeserve:expert_balancedness", "mean / max routed tokens per GPU over the "
                                         "recorder's window, averaged over MoE layers (1: balanced)").labels(**labels)
        self.expert_rebalances = gauge("moeserve:expert_rebalances", "online expert rebalances done").labels(**labels)
        self.expert_max_pause = gauge("moeserve:expert_rebalance_max_pause_seconds", "the longest pause between two "
                                      "steps a rebalance took").labels(**labels)
        self._labels = labels

    def update_engine(self, stats: list[EngineStats]) -> None:
        """The latest report of every DP group, summed."""
        self.num_running.set(sum(s.num_running for s in stats))
        self.num_queued.set(sum(s.num_waiting for s in stats))
        self.pages_used.set(sum(s.pages_used for s in stats))
        self.pages_total.set(sum(s.pages_total for s in stats))
        self.pages_cached.set(sum(s.pages_cached for s in stats))
        hits, prompts = sum(s.prefix_hit_tokens for s in stats), sum(s.prefix_prompt_tokens for s in stats)
        self.prefix_hit_tokens.set(hits)
        self.prefix_prompt_tokens.set(prompts)
        self.prefix_hit_rate.set(hits / prompts if prompts else 0.0)
        verified, emitted = sum(s.spec_verified for s in stats), sum(s.spec_emitted for s in stats)
        self.spec_verified.set(verified)
        self.spec_emitted.set(emitted)
        self.spec_accept_length.set(emitted / verified if verified else 0.0)
        self.engine_rejected_messages.set(sum(s.rejected_messages for s in stats))
        for name in {k for s in stats for k in s.pd_queues}:
            self.pd_queue.labels(**self._labels, queue=name).set(sum(s.pd_queues.get(name, 0) for s in stats))
        for result in {k for s in stats for k in s.transfers}:
            self.transfers.labels(**self._labels, result=result).set(sum(s.transfers.get(result, 0) for s in stats))
        self.transfer_bytes.set(sum(s.transfer_bytes for s in stats))
        self.transfer_seconds.set(sum(s.transfer_seconds for s in stats))
        self.transfer_writes.set(sum(s.transfer_writes for s in stats))
        self.prefill_peers_lost.set(sum(s.prefill_peers_lost for s in stats))
        measured = [s.expert_balancedness for s in stats if s.expert_balancedness is not None]
        if measured:  # every rank reports the same figure (summed over the world)
            self.expert_balancedness.set(measured[0])
        self.expert_rebalances.set(max(s.expert_rebalances for s in stats))
        self.expert_max_pause.set(max(s.expert_max_pause_s for s in stats))
        for stage in {k for s in stats for k in s.ended_early}:
            self.ended_early.labels(**self._labels, stage=stage).set(sum(s.ended_early.get(stage, 0) for s in stats))

    def refused(self, reason: str) -> None:
        self.refused_requests.labels(**self._labels, reason=reason).inc()

    def finished(self, reason: str) -> None:
        self.requests.labels(**self._labels, finish_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
