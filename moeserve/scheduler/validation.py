"""Request validation that needs no model: the API process runs it before a response starts
(so it imports no model code, and the grammar library only for a request with a grammar), the
scheduler again on arrival."""

from __future__ import annotations

from moeserve.config import EngineConfig
from moeserve.core import SamplingParams
from moeserve.executor.grammar import GRAMMAR_FIELDS, check_grammar


def check_request(prompt_ids: list[int], params: SamplingParams, config: EngineConfig, kv_capacity: int,
                  has_tokenizer: bool) -> None:
    """Raise ValueError naming the problem when a request can never run.

    The API process calls this too, so bad input is refused before a response starts streaming.
    """
    params.validate()
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer, and this model folder has none; use stop_token_ids")
    if not prompt_ids:
        raise ValueError("prompt is empty")
    context = config.context_length
    if len(prompt_ids) >= context:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens, the context length is {context}")
    if len(prompt_ids) + params.max_tokens > context:
        raise ValueError(f"max_tokens ({params.max_tokens}) plus the prompt ({len(prompt_ids)} tokens) "
                         f"exceeds the context length {context}")
    if len(prompt_ids) + params.max_tokens > kv_capacity:
        raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                         f"can never fit in the KV cache of {kv_capacity} tokens")
    # after the length checks, so a huge prompt is refused before it is scanned
    vocab = config.model.vocab_size
    bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad[:5]}")
    bad = [t for t in params.logit_bias or {} if t >= vocab]
    if bad:
        raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {bad[:5]}")
    controls = [name for name in ("logit_bias", "min_tokens", "prompt_logprobs", *GRAMMAR_FIELDS)
                if getattr(params, name) not in (None, 0, {})]
    if controls and config.spec.enabled:
        raise ValueError(f"{controls[0]} is not supported with speculative decoding (--speculative-algorithm) yet")
    if params.priority and not config.scheduler.enable_priority_scheduling:
        raise ValueError("priority needs the server started with --enable-priority-scheduling")
    if params.prompt_logprobs is not None and (config.disagg.enabled or config.parallel.dp_size > 1):
        raise ValueError("prompt_logprobs (echo with logprobs) is not supported on disaggregated servers or with "
                         "DP attention yet")
    if params.constrained:
        if not has_tokenizer:
            raise ValueError("structured outputs need a tokenizer, and this model folder has none")
        check_grammar(params, config.scheduler.grammar_backend)
