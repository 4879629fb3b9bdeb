"""Per-request sampling parameters (vLLM / SGLang semantics), validated at construction.

Invariants after ``__post_init__`` (a ``SamplingParams`` is frozen, so they hold forever):

- every numeric field has the right type (``bool`` is never accepted as a number) and is finite;
- ``top_k`` is ``-1`` (disabled) or ``>= 1`` (``0`` is normalized to ``-1``);
- ``stop`` is a tuple of non-empty strings, ``stop_token_ids`` a tuple of ints ``>= 0``;
- ``stop_regex`` is a tuple of at most ``MAX_STOP_REGEX`` patterns that compile with ``re``
  and match no empty string (``compiled_stop_regex`` holds them compiled);
- ``top_logprobs > 0`` implies ``logprobs`` (normalized to ``True``);
- ``logit_bias`` is a tuple of ``(token_id >= 0, bias in [-100, 100])`` pairs sorted by id (a
  mapping is converted); ids are checked against the vocabulary by ``Engine.submit``;
- ``constraint`` is None or a ``Constraint`` (a mapping of ``Constraint.from_params`` keywords,
  e.g. ``{"json_schema": schema}``, is converted); its deeper checks (metaschema, unsupported
  keywords, regex syntax) happen in ``Engine.submit``, which knows the grammar backend.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.grammar.constraint import Constraint

MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_STOP_REGEX = 32
MAX_STOP_REGEX_BYTES = 256
_SEED_LIMIT = 2**64


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuation. Immutable and hashable.

    ``temperature == 0`` (or ``top_k == 1``) means greedy decoding. ``stop`` accepts a single
    string or a sequence of strings. ``seed`` makes sampling reproducible per request,
    independent of the other requests in the batch. ``constraint``: the output must match it
    (JSON schema, regex, EBNF, choices; see ``radixlm.runtime.grammar.Constraint``).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    # Regular expressions (Python `re`): generation stops as soon as the generated text contains
    # a match; the output ends where that match ends (the match is kept, as in SGLang).
    stop_regex: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None
    # Added to the logits before sampling (OpenAI `logit_bias`); -100 effectively bans a token.
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    # Prompt logprobs (SGLang's name): >= 0 returns, for each prompt position i >= this, the
    # logprob of prompt token i given the tokens before it. -1: off.
    logprob_start_len: int = -1

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        max_new = _check_int("max_new_tokens", self.max_new_tokens)
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
        min_new = _check_int("min_new_tokens", self.min_new_tokens)
        if not 0 <= min_new <= max_new:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={max_new}], got {min_new}"
            )
        self._set_float("temperature", lambda v: v >= 0, ">= 0")
        top_k = _check_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {top_k}")
        set_(self, "top_k", -1 if top_k == 0 else top_k)
        self._set_float("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        self._set_float("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
        self._set_float("repetition_penalty", lambda v: v > 0, "> 0")
        self._set_float("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        self._set_float("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            if not 0 <= seed < _SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        set_(self, "stop", self._normalize_stop(self.stop))
        set_(self, "stop_regex", self._normalize_stop_regex(self.stop_regex))
        set_(self, "stop_token_ids", self._normalize_stop_token_ids(self.stop_token_ids))
        set_(self, "logit_bias", self._normalize_logit_bias(self.logit_bias))
        for name in ("ignore_eos", "skip_special_tokens", "logprobs", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        top_lp = _check_int("top_logprobs", self.top_logprobs)
        if not 0 <= top_lp <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_lp}")
        if top_lp > 0:
            set_(self, "logprobs", True)
        n = _check_int("n", self.n)
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {n}")
        set_(self, "constraint", self._normalize_constraint(self.constraint))
        if _check_int("logprob_start_len", self.logprob_start_len) < -1:
            raise ValueError(f"logprob_start_len must be >= -1, got {self.logprob_start_len}")

    def _set_float(self, name: str, ok: Any, rule: str) -> None:
        value = _check_float(name, getattr(self, name))
        if not ok(value):
            raise ValueError(f"{name} must be {rule}, got {value!r}")
        object.__setattr__(self, name, value)

    @staticmethod
    def _normalize_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else stop
        if not isinstance(items, Sequence):
            raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
        out = tuple(items)
        for s in out:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {stop!r}")
        return out

    @staticmethod
    def _normalize_stop_regex(value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        items = (value,) if isinstance(value, str) else value
        if isinstance(items, bytes) or not isinstance(items, Sequence):
            raise ValueError(f"stop_regex must be a str or a list of str, got {value!r}")
        out = tuple(items)
        if len(out) > MAX_STOP_REGEX:
            raise ValueError(f"stop_regex: at most {MAX_STOP_REGEX} patterns, got {len(out)}")
        for pattern in out:
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"stop_regex must contain non-empty strings, got {value!r}")
            if len(pattern.encode()) > MAX_STOP_REGEX_BYTES:
                raise ValueError(
                    f"stop_regex: a pattern is over {MAX_STOP_REGEX_BYTES} bytes: {pattern[:40]!r}"
                )
            try:
                compiled = compile_stop_regex(pattern)
            except (re.error, RecursionError, OverflowError) as exc:
                raise ValueError(f"stop_regex: invalid pattern {pattern!r}: {exc}") from None
            if compiled.fullmatch("") is not None:
                raise ValueError(f"stop_regex: {pattern!r} matches the empty string")
        return out

    @staticmethod
    def _normalize_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError(f"stop_token_ids must be a list of int, got {ids!r}")
        out = tuple(ids)
        for t in out:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must contain ints >= 0, got {ids!r}")
        return out

    @staticmethod
    def _normalize_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
        if value is None:
            return ()
        items = value.items() if isinstance(value, Mapping) else value
        out: dict[int, float] = {}
        try:
            pairs = [tuple(p) for p in items]
        except TypeError:
            raise ValueError(f"logit_bias must map token ids to floats, got {value!r}") from None
        for pair in pairs:
            if len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to floats, got {value!r}")
            tok = _check_int("logit_bias", pair[0])
            bias = _check_float("logit_bias", pair[1])
            if tok < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {tok}: {bias}"
                )
            out[tok] = bias
        return tuple(sorted(out.items()))

    @staticmethod
    def _normalize_constraint(value: Any) -> Constraint | None:
        if value is None:
            return None
        if isinstance(value, Constraint):
            return value
        if isinstance(value, Mapping):
            try:
                return Constraint.from_params(**value)
            except TypeError as exc:  # an unknown keyword
                raise ValueError(f"constraint: {exc}") from None
            except ValueError as exc:
                raise ValueError(f"constraint: {exc}") from None
        raise ValueError(
            f"constraint must be a Constraint or a mapping of its fields, got {value!r}"
        )

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition / frequency / presence penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def compiled_stop_regex(self) -> tuple[re.Pattern[str], ...]:
        return tuple(compile_stop_regex(p) for p in self.stop_regex)

    @property
    def max_stop_str_len(self) -> int:
        """Length of the longest stop string (0 when there is none)."""
        return max((len(s) for s in self.stop), default=0)


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> re.Pattern[str]:
    """`re.compile`, cached: the same stop patterns recur across requests."""
    return re.compile(pattern)
