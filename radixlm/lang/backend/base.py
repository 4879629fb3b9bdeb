"""The backend interface the interpreter calls, and `select` on top of it.

A backend generates from a text prompt, streams, caches a prefix, tokenizes, renders roles with
the model's chat template and scores prompts (the logprob of every prompt token from a start
position on). `select` is the same for every backend:

1. tokenize the prefix and each `prefix + choice` (one tokenization of the whole text, so that a
   token that merges across the boundary is scored as the model would see it); a choice's
   tokens start where its ids leave the prefix's ids;
2. send the prefix once (`cache_prefix`), so that the radix cache holds it;
3. score all choices together in one batch, each from its own start position (the shared
   prefix is matched in the cache, not recomputed);
4. for `unconditional_likelihood_normalized`, also score each choice's tokens with no context.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Iterator, Sequence
from typing import Any

from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoicesDecision, ChoicesSamplingMethod, sample_index
from radixlm.lang.ir import GenParams

Meta = dict[str, Any]


class BaseBackend(abc.ABC):
    """What a program needs from a model server. Methods may be called from many threads."""

    @abc.abstractmethod
    def generate(self, prompt: str, params: GenParams) -> tuple[str | list[str], Meta]:
        """The completion (a list of `n` completions when `params.n > 1`) and its meta info."""

    @abc.abstractmethod
    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[tuple[str, Meta]]:
        """(new text, meta info so far) deltas of one completion."""

    @abc.abstractmethod
    def cache_prefix(self, prompt: str | Sequence[int]) -> None:
        """Compute `prompt` once so that later requests sharing it hit the radix cache."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def score(self, prompts: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[Any]]:
        """For each prompt, the logprob of each token at positions `start..len-1` given the
        tokens before it (None for position 0). All prompts are submitted together."""

    @abc.abstractmethod
    def get_chat_template(self) -> ChatTemplate: ...

    def stats(self) -> dict[str, Any]:
        """The engine's counters (`computed_prompt_tokens`, `cache_hit_tokens`, ...); empty
        when the backend has none."""
        return {}

    def flush_cache(self) -> bool:
        return False

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release the backend's resources."""

    def select(
        self,
        prefix: str,
        choices: Sequence[str],
        temperature: float,
        method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        choices = list(choices)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"select: choices must be non-empty strings, got {choices!r}")
        prefix_ids = self.tokenize(prefix) if prefix else []
        full = [self.tokenize(prefix + c) for c in choices]
        starts = [min(max(1, _common_len(prefix_ids, ids)), len(ids) - 1) for ids in full]
        if any(s < 1 for s in starts):  # a one-token prompt cannot be scored
            raise ValueError("select: a choice after an empty prefix must be 2+ tokens long")
        if prefix_ids:
            self.cache_prefix(prefix_ids)
        scored = self.score(full, starts)
        logprobs = [
            [[lp, tid, None] for lp, tid in zip(lps, ids[s:])]
            for lps, ids, s in zip(scored, full, starts)
        ]
        normalized = [sum(t[0] for t in lps) / len(lps) for lps in logprobs]
        unconditional = None
        if method.requires_unconditional_logprobs:
            alone = [ids[s:] for ids, s in zip(full, starts)]
            uncond = self.score(alone, [0] * len(alone))
            unconditional = [
                [[lp, tid, None] for lp, tid in zip(lps, ids)] for lps, ids in zip(uncond, alone)
            ]
        decision = method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=logprobs,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=unconditional,
        )
        if temperature > 0 and decision.scores is not None:
            decision.decision = choices[sample_index(decision.scores, temperature, random.random())]
        return decision


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_scores(scored: list[list[Any]], prompts: Sequence[Sequence[int]], starts: Sequence[int]):
    """Normalize prompt logprobs to positions `start..end` (a backend may return them indexed
    from 0 or from `start`) and check their count."""
    out = []
    for lps, ids, s in zip(scored, prompts, starts):
        if not lps and s == 0 and len(ids) == 1:
            lps = [None]  # a one-token prompt: nothing predicts its only token
        if lps is None:
            raise RuntimeError("backend returned no prompt logprobs")
        lps = list(lps)
        if len(lps) == len(ids) and s > 0:
            lps = lps[s:]
        if len(lps) != len(ids) - s:
            raise RuntimeError(
                f"backend returned {len(lps)} prompt logprobs for {len(ids) - s} positions"
            )
        out.append(lps)
    return out
