"""Request state, with one accounting for prefill, chunked prefill, prefix hits and decode.

A request owns `token_ids` (prompt + generated) and `num_computed_tokens`: the tokens whose K/V
are in its pages. Each step computes a slice of the difference; a prefix hit just starts
`num_computed_tokens` above zero. The last sampled token is never computed until the next step
(after a jump-forward, several appended tokens are not: the next step extends by all of them).

Constrained requests: `grammar_future` (set at submit) resolves to the compiled grammar; the
scheduler admits the request only then and gives it `grammar`, its matcher. NOTE: the matcher
has accepted exactly the output tokens (`output_token_ids`) at all times while the request is
unfinished, so retraction (which keeps `token_ids`) needs nothing, and an n > 1 branch starts
from a fork of its parent's matcher taken before the first sample. A verified request's last
output tokens may be `held` (not yet released to the client): a dead end may roll them back.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixlm.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixlm.runtime.grammar.base import CompiledGrammar, GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One delta for one sequence (branch `index` of its request group)."""

    request_id: str
    index: int
    text: str  # new text since the previous delta
    token_ids: list[int]  # new tokens since the previous delta
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    # Why an "error" finish happened: "grammar_timeout", "grammar_error", "internal", ...
    error_code: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None  # on the finishing delta, when asked
    # With top_logprobs > 0: the top (token, logprob) pairs per prompt position (None at 0).
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


OutputSink = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Request:
    """One sequence. Who writes which field (enforced by tests/runtime/test_ownership.py):

    - identity and params: set at construction (the front end, or the scheduler's fork of a
      branch), with `grammar_future`, `sink` and `detokenizer` attached before it is queued;
      read-only afterwards;
    - sequence and page state (`SEQUENCE_FIELDS`): the scheduler package alone
      (`radixlm/runtime/scheduler/`);
    - output state (`OUTPUT_FIELDS`): the output processor alone.

    The executor writes nothing (a seeded request's generator is the executor's own state).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: OutputSink | None = None
    namespace: Hashable | None = None
    index: int = 0  # branch index within an n > 1 group
    arrival_time: float = field(default_factory=time.monotonic)

    # ---- sequence and page state: the scheduler's --------------------------------------------
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    # Bumped whenever `pages` changes other than by appending (adoption, release, fork): the
    # executor's persistent page table rewrites the row then, else it only appends.
    page_gen: int = 0
    # Hybrid pool (sliding-window layers): the request holds the window part of
    # `pages[swa_start:]` only; earlier pages' window K/V is released (never read again).
    swa_start: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None
    num_cached_tokens: int = 0  # prefix-cache hit of the first admission (reported in usage)
    admitted_once: bool = False
    num_retractions: int = 0
    # Occurrences of each token in the output, kept as tokens are appended (penalties read it
    # instead of recounting the whole output every step).
    output_counts: Counter[int] = field(default_factory=Counter, repr=False)
    # The incremental detokenizer: it finds stop strings, which end the sequence.
    detokenizer: Any = None
    # The last output tokens held back from the client, (text, logprob) each: a verified
    # request's open value that a dead end may still roll back (``GrammarMatcher.num_settled``).
    held: list[tuple[str, TokenLogprob | None]] = field(default_factory=list, repr=False)
    # n > 1: branches still to fork from this request once its prompt is computed.
    pending_forks: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    grammar_future: Future[CompiledGrammar] | None = field(default=None, repr=False)
    grammar: GrammarMatcher | None = field(default=None, repr=False)
    _prompt_page_hashes: list[int] | None = field(default=None, repr=False)
    _prompt_token_set: frozenset[int] | None = field(default=None, repr=False)

    # ---- output state: the output processor's -----------------------------------------------
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # logprob_start_len >= 0: entry j is the logprob of prompt token (start + j); None for
    # position 0 (nothing predicts it).
    prompt_logprobs: list[float | None] | None = None
    # ... and with top_logprobs > 0, the top (token, logprob) pairs at those positions.
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.pending_forks = self.params.n - 1 if self.index == 0 else 0
        k = self.prompt_logprob_start
        if k is not None:
            self.prompt_logprobs = [None] * (self.num_prompt_tokens - k)
            if self.params.top_logprobs > 0:
                self.prompt_top_logprobs = [None] * (self.num_prompt_tokens - k)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_final_tokens(self) -> int:
        """Tokens (prompt included) released to the client: never rolled back, the only ones
        that may enter the radix tree while the request runs."""
        return len(self.token_ids) - len(self.held)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_set(self) -> frozenset[int]:
        """The distinct prompt tokens (computed once; repetition penalty)."""
        if self._prompt_token_set is None:
            self._prompt_token_set = frozenset(self.prompt_token_ids)
        return self._prompt_token_set

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def grammar_pending(self) -> bool:
        """Constrained, and its grammar is not compiled yet (or its failure not handled)."""
        return self.grammar_future is not None and self.grammar is None

    @property
    def prompt_logprob_start(self) -> int | None:
        """First prompt position whose logprob is wanted (None: prompt logprobs off)."""
        k = self.params.logprob_start_len
        if k < 0 or self.index != 0:
            return None
        return min(k, self.num_prompt_tokens)

    def prompt_logprob_positions(self, start: int, n: int) -> range:
        """Positions p in the chunk [start, start + n) whose logits predict a wanted prompt
        token p + 1."""
        k = self.prompt_logprob_start
        if k is None:
            return range(0)
        return range(max(start, k - 1), min(start + n, self.num_prompt_tokens - 1))

    def prompt_page_hashes(self, page_size: int) -> list[int]:
        """Chained hashes of the prompt's full pages: entry k identifies `prompt[: (k+1)*ps]`."""
        if self._prompt_page_hashes is None:
            hashes, h = [], 0
            ids = self.prompt_token_ids
            for end in range(page_size, len(ids) + 1, page_size):
                h = hash((h, tuple(ids[end - page_size : end])))
                hashes.append(h)
            self._prompt_page_hashes = hashes
        return self._prompt_page_hashes

    def pages_needed(self, num_tokens: int, page_size: int) -> int:
        """Extra pages to hold `num_tokens` tokens in total."""
        return max(0, -(-num_tokens // page_size) - len(self.pages))


SEQUENCE_FIELDS = frozenset(
    {
        "token_ids",
        "num_computed_tokens",
        "pages",
        "page_gen",
        "swa_start",
        "status",
        "finish_reason",
        "stop_reason",
        "error",
        "error_code",
        "num_cached_tokens",
        "admitted_once",
        "num_retractions",
        "output_counts",
        "detokenizer",
        "held",
        "pending_forks",
        "first_token_time",
        "finish_time",
        "grammar",
        "_prompt_page_hashes",
        "_prompt_token_set",
    }
)
OUTPUT_FIELDS = frozenset({"output_logprobs", "prompt_logprobs", "prompt_top_logprobs"})
