"""The offline façade: ``LLM(model_path=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from moeserve.config import build_engine_config
from moeserve.core import Req, SamplingParams, TokenLogprob
from moeserve.executor.model_runner import ModelRunner
from moeserve.models.tokenizer import load_tokenizer
from moeserve.scheduler.controls import ExpertControls
from moeserve.scheduler.io import ControlOutput, ExpertAction, ExpertControlInput
from moeserve.scheduler.scheduler import Scheduler, with_dispatch_cap
from moeserve.scheduler.validation import check_request

if TYPE_CHECKING:
    from moeserve.scheduler.ranked_engine import RankedEngine

Prompt = str | list[int]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs


class LLM:
    """The engine behind a Python call. Settings are the CLI's flags as keyword arguments.

    One rank runs in this process; a parallel layout (``tp_size`` > 1 …) starts the rank
    processes, exactly as ``moeserve serve`` does, and talks to them over ZMQ.

    ``shutdown()`` (or leaving a ``with`` block) stops the rank processes and frees the model; an
    LLM that is dropped, or still alive when the interpreter exits, stops its ranks all the same
    (``RankedEngine``'s finalizer).
    """

    def __init__(self, model_path: str, **settings: Any) -> None:
        self.config = build_engine_config(model_path, **settings)
        self.tokenizer = load_tokenizer(self.config.load.tokenizer_path or model_path)
        self._ranks: RankedEngine | None = None  # several ranks: processes reached over ZMQ
        if self.config.parallel.world_size > 1:
            from moeserve.scheduler.ranked_engine import RankedEngine  # needs pyzmq; one rank does not

            self._ranks = RankedEngine(self.config)
        else:
            self.runner = ModelRunner(self.config)
            self.scheduler = Scheduler(with_dispatch_cap(self.config, 1), self.runner, self.tokenizer)
        self._ids = itertools.count()
        self._shut_down = False

    def shutdown(self) -> None:
        """Stop the rank processes and release the sockets and the model; a second call does
        nothing. ``generate`` and the expert calls raise afterwards."""
        self._shut_down = True
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None
        else:
            self.runner = self.scheduler = None  # this process's rank: its model and KV cache

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    def _check_running(self) -> None:
        if self._shut_down:
            raise RuntimeError("this LLM has been shut down")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text or a list of token ids."""
        self._check_running()
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        token_lists = [self._encode(p) for p in prompt_list]
        if self._ranks is not None:
            for ids, p in zip(token_lists, params):
                check_request(ids, p, self.config, self._ranks.max_total_tokens, self.tokenizer is not None)
            return [_output(r) for r in self._ranks.generate(token_lists, params, use_tqdm)]
        reqs: list[Req] = []
        try:
            for ids, p in zip(token_lists, params):
                reqs.append(self.scheduler.add_request(f"offline-{next(self._ids)}", ids, p))
        except ValueError:
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        with tqdm(total=len(reqs), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while not all(r.finished for r in reqs):
                finished = sum(r.finished for r in self.scheduler.step())
                bar.update(finished)
        return [_output(r) for r in reqs]

    # ---- the expert recorder and placement (as the server's HTTP paths) ----------------------------
    def start_expert_distribution_record(self) -> dict:
        return self._expert_control("start_record")

    def stop_expert_distribution_record(self) -> dict:
        return self._expert_control("stop_record")

    def dump_expert_distribution_record(self) -> dict:
        """Write the recorded load (``eplb.files`` format); ``{"path": ...}``."""
        return self._expert_control("dump_record")

    def rebalance_experts(self) -> dict:
        """Rebalance now from the recorded window (with ``enable_eplb``); returns when done."""
        return self._expert_control("rebalance")

    def expert_stats(self) -> dict:
        """Rebalances, balancedness, pauses and the current ``phy2log``."""
        return self._expert_control("stats")

    def _expert_control(self, action: ExpertAction) -> dict:
        self._check_running()
        if self._ranks is not None:
            answer = self._ranks.control(action)
        else:
            answers: list[ControlOutput] = []
            controls = ExpertControls(self.runner.eplb, self.config.eplb, answers.append)
            controls.add(ExpertControlInput(1, action))
            controls.run(1)
            while not answers:  # a rebalance moves on between passes: idle ones, here
                self.runner.forward(None)
            answer = answers[0]
        if not answer.ok:
            raise ValueError(answer.message)
        return answer.result

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so it has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([ids], sampling_params, use_tqdm=False)[0]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this model folder has none; pass token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        return list(prompt)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return params


def _output(req: Req) -> RequestOutput:
    return RequestOutput(
        prompt_token_ids=req.prompt_ids, text=req.text, token_ids=list(req.output_ids),
        finish_reason=req.finish_reason.value,
        logprobs=req.output_logprobs if req.params.logprobs is not None else None,
        prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        cached_tokens=req.cached_tokens,
    )
