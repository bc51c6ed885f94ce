"""Plain types shared by every layer: sampling parameters, requests, forward batches."""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SamplingParams:
    """How to pick tokens for one request; names and meanings follow the OpenAI API.

    ``top_k <= 0`` disables top-k; ``logprobs=None`` returns no logprobs, ``logprobs=k`` returns
    the chosen token's logprob and the ``k`` most likely alternatives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # the logprob of every prompt token after the first, with this many alternatives (vLLM's name;
    # OpenAI's echo + logprobs, lm-eval's loglikelihood); the prefix cache is skipped for them
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0  # the stop tokens are held back until this many tokens are out
    priority: int = 0  # with --enable-priority-scheduling: the admission order (SGLang's: larger first)
    # constrained decoding (at most one; ``executor/grammar.py``): a JSON schema (as JSON text), a
    # regular expression, or an EBNF grammar the output must match
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range (ranges: ``SAMPLING_LIMITS``)."""
        _check(_int(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_finite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
               "temperature", f"must be in [0, {MAX_TEMPERATURE}], got {self.temperature!r}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1,
               "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_int(self.top_k) and self.top_k >= -1,
               "top_k", f"must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1,
               "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        low, high = REPETITION_PENALTY_RANGE
        _check(_finite(self.repetition_penalty) and low <= self.repetition_penalty <= high,
               "repetition_penalty", f"must be in [{low}, {high}], got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_int(value) and 0 <= value <= MAX_LOGPROBS),
                   name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"has {len(self.stop)} strings, at most "
               f"{MAX_STOP_STRINGS} are allowed")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in self.stop),
               "stop", f"must be non-empty strings of at most {MAX_STOP_LENGTH} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"has {len(self.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS} are allowed")
        _check(all(_int(t) and 0 <= t < 2**63 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        _check(self.seed is None or (_int(self.seed) and -2**63 <= self.seed < 2**63),
               "seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        bias = self.logit_bias or {}
        _check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
        _check(all(_int(t) and t >= 0 for t in bias), "logit_bias", "keys must be token ids (integers >= 0)")
        _check(all(_finite(b) and -100 <= b <= 100 for b in bias.values()), "logit_bias",
               "values must be numbers in [-100, 100]")
        _check(_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        _check(_int(self.priority) and -2**31 <= self.priority < 2**31, "priority",
               f"must be a 32-bit integer, got {self.priority!r}")
        grammars = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        _check(len(grammars) <= 1, grammars[-1] if grammars else "json_schema",
               f"give at most one of json_schema, regex and ebnf; got {', '.join(grammars)}")
        for name in grammars:
            _check(isinstance(getattr(self, name), str) and 0 < len(getattr(self, name)) <= MAX_GRAMMAR_CHARS, name,
                   f"must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
        for name in ("ignore_eos", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")

    @property
    def constrained(self) -> bool:
        """Whether a grammar holds the output (``executor/grammar.py``)."""
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def greedy(self) -> bool:
        """Temperatures below ``SAMPLING_EPS`` mean greedy, as in vLLM and SGLang: dividing by them
        would overflow float32 logits."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1


# The ranges ``SamplingParams.validate`` enforces (docs/security.md lists them).
SAMPLING_EPS = 1e-5
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 10.0)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_GRAMMAR_CHARS = 1 << 20


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"  # the engine failed while running this request; ``finish_message`` says why


@dataclass
class TokenLogprob:
    """Logprob of the chosen token and the most likely alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class BootstrapInfo:
    """The other side of a disaggregated request: the prefill server's bootstrap address and the
    request's room, a random 63-bit id both servers know it by (the router picks all three)."""

    host: str
    port: int
    room: int
    prefill_dp_rank: int | None = None  # the prefill DP group that computes it (default: room mod dp)

    def __post_init__(self) -> None:
        if not (isinstance(self.room, int) and 0 <= self.room < 2**63):
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**63), got {self.room!r}")
        if not (isinstance(self.port, int) and 0 < self.port < 65536):
            raise ValueError(f"bootstrap_port must be a port number, got {self.port!r}")
        if self.prefill_dp_rank is not None and not (isinstance(self.prefill_dp_rank, int)
                                                     and self.prefill_dp_rank >= 0):
            raise ValueError(f"prefill_dp_rank must be a non-negative integer, got {self.prefill_dp_rank!r}")


@dataclass
class Req:
    """One request as the scheduler sees it.

    ``fill_ids = prompt_ids + output_ids``; the KV cache holds the first ``kv_len`` of them, in
    the slots listed by ``page_table`` (page ids; slot = page * page_size + offset).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # with params.prompt_logprobs: entry i is prompt token i's (None for the first), as computed so far
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    kv_len: int = 0
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    finish_message: str | None = None
    error_status: int = 500  # the HTTP status of an ERROR finish: 500 the engine failed, 503 it was overloaded
    text: str = ""
    generator: torch.Generator | None = None
    num_retractions: int = 0
    # when it joined the prefill queue, for ``--queue-timeout``; None once its prefill has started
    queued_at: float | None = None
    bootstrap: BootstrapInfo | None = None  # set on both servers of a disaggregated request
    # the prefix cache: ``page_table[:shared_pages]`` are its pages, pinned through the node it
    # locked for this request (``prefix_node``); ``cached_tokens`` of the prompt came from it
    prefix_node: Any = None
    constraint: Any = None  # the grammar's matcher of a constrained request (``executor/grammar.py``)
    shared_pages: int = 0
    cached_tokens: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building the whole list (decode reads one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def finish(self, reason: FinishReason, message: str | None = None) -> None:
        self.status = ReqStatus.FINISHED
        self.finish_reason = reason
        self.finish_message = message


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly a chunk that continues an earlier one
    DECODE = "decode"  # one new token per sequence
    IDLE = "idle"  # no tokens; keeps collectives of a data-parallel rank in step
    # speculative decoding: each sequence's last token and its drafts, the same count for every
    # sequence, attending the cache as decode does (absorbed MLA, several queries a sequence)
    VERIFY = "verify"

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


class Yield:
    """The marker in a model's operation list where one micro-batch may hand over to the other
    (two-batch overlap, ``executor/overlap.py``); plain execution skips it."""

    def __repr__(self) -> str:
        return "YIELD"


YIELD = Yield()


@dataclass
class DPInfo:
    """What the ranks agreed on for one step, known to every rank.

    ``token_counts[d]`` / ``seq_counts[d]``: new tokens and sequences of data-parallel group ``d``
    (0 for an idle group); ``moe_mode``: the dispatch mode all ranks use this step; ``halves``: set
    when the step runs as two overlapped micro-batches, the same for each of them; ``graph_bucket``:
    set when every rank replays its decode CUDA graph of this many sequences a DP group (each pads
    its batch up to it; an idle one runs padding only).
    """

    token_counts: list[int]
    seq_counts: list[int]
    moe_mode: str = "normal"
    halves: tuple[DPInfo, DPInfo] | None = None  # two-batch overlap: every group's two micro-batches
    any_extend: bool = True  # some group prefills: every rank overlaps with the prefill strategy
    graph_bucket: int | None = None


@dataclass
class ForwardBatch:
    """Everything one forward pass needs, as tensors on the model's device.

    T = tokens in the batch, B = sequences. For sequence ``i`` the batch carries
    ``extend_lens[i]`` new tokens at positions ``prefix_lens[i] ..``; its whole context after this
    step occupies the cache slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, cache slot written by each new token
    prefix_lens: torch.Tensor  # [B] int64, tokens already cached before this step
    extend_lens: torch.Tensor  # [B] int64, new tokens in this step
    kv_indptr: torch.Tensor  # [B + 1] int64
    kv_indices: torch.Tensor  # [sum(prefix + extend)] int64
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    kv_pool: Any = None  # the MLAKVPool the attention layers read and write
    page_size: int | None = None  # kv_indices lie on pages of this many slots (slot = page * size + t % size)
    dp: DPInfo | None = None  # what every data-parallel group runs this step
    # kernels that size their launch by the batch (MLA decode's KV splits) size it as for this
    # many sequences: a two-batch-overlap micro-batch gives its whole batch's, so that splitting
    # a batch changes no sequence's order of reduction
    launch_batch_size: int | None = None
    # a CUDA graph's bound on every sequence's length (DeepSeek-V3.2's indexer sizes its scores by
    # it); None: the longest of ``seq_lens_cpu``
    context_bucket: int | None = None

    def dp_info(self) -> DPInfo:
        return self.dp or DPInfo([self.num_tokens], [self.batch_size], "normal")

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens_per_seq(self) -> int:
        """VERIFY: query tokens per sequence (each sequence's last ones; the same for all)."""
        return self.extend_lens_cpu[0] if self.extend_lens_cpu else 1

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu)]

    @property
    def max_context(self) -> int:
        """A bound on every sequence's length, known on the host."""
        return self.context_bucket if self.context_bucket is not None else max(self.seq_lens_cpu, default=0)

    def last_token_index(self) -> torch.Tensor:
        """[B] index of each sequence's last new token in the flat token dimension."""
        return torch.cumsum(self.extend_lens, 0) - 1


@dataclass
class ScheduledSeq:
    """One request's share of a step: compute ``req.fill_ids[start:end]``."""

    req: Req
    start: int
    end: int
    # the input tokens when they are not ``req.fill_ids[start:end]``: a verify step's drafts, the
    # MTP module's inputs (each position's next token)
    tokens: list[int] | None = None

    @property
    def completes_fill(self) -> bool:
        """True when this step reaches the end of the request's known tokens, so it samples."""
        return self.end == self.req.seq_len


@dataclass
class ScheduleBatch:
    """What the scheduler decided to run this step."""

    mode: ForwardMode
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.seqs)

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits the step computes: one a sequence, every token of a verify step."""
        return self.num_tokens if self.mode is ForwardMode.VERIFY else len(self.seqs)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Run a block with torch's default dtype set to ``dtype`` (modules built in it take it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
