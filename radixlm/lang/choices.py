"""How `select` picks a choice from the model's logprobs of each choice after the shared prefix.

Inputs are in SGLang's format: `input_token_logprobs[i]` is `[[logprob, token_id, text], ...]`
over choice `i`'s tokens (conditioned on the prefix), and `unconditional_token_logprobs[i]` the
same tokens scored with no context (the first logprob is None). Each method returns the decision
and its per-choice `scores` (higher is better; None for a method that is not a score argmax).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any

TokenLogprobs = list[list[Any]]  # [[logprob, token_id, text], ...]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)
    scores: list[float] | None = None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _argmax_first(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


class ChoicesSamplingMethod(abc.ABC):
    requires_unconditional_logprobs: bool = False

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[TokenLogprobs],
        output_token_logprobs: list[TokenLogprobs],
        unconditional_token_logprobs: list[TokenLogprobs] | None = None,
    ) -> ChoicesDecision:
        meta: dict[str, Any] = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        }
        best, scores = self.decide(
            normalized_prompt_logprobs, input_token_logprobs, unconditional_token_logprobs, meta
        )
        return ChoicesDecision(choices[best], meta, scores)

    @abc.abstractmethod
    def decide(
        self,
        normalized: list[float],
        logprobs: list[TokenLogprobs],
        unconditional: list[TokenLogprobs] | None,
        meta: dict[str, Any],
    ) -> tuple[int, list[float] | None]:
        """(index of the decision, per-choice scores or None); may add entries to `meta`."""


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob per token (the default)."""

    def decide(self, normalized, logprobs, unconditional, meta):
        return _argmax_first(normalized), list(normalized)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the choices with the highest logprob at position j = 0, 1, ...
    until one is left. A shorter choice is padded with its own mean logprob."""

    def decide(self, normalized, logprobs, unconditional, meta):
        width = max(len(lps) for lps in logprobs)
        matrix = []
        for lps in logprobs:
            row = [float(t[0]) for t in lps]
            matrix.append(row + [_mean(row)] * (width - len(row)))
        remaining = list(range(len(logprobs)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        meta["greedy_logprob_matrix"] = matrix
        return remaining[0], None


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of `logprob(token | prefix) - logprob(token | no
    context)`: discounts choices that are likely whatever the question."""

    requires_unconditional_logprobs = True

    def decide(self, normalized, logprobs, unconditional, meta):
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for cond, uncond in zip(logprobs, unconditional):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional logprobs differ in length")
            u = [float(t[0]) if t[0] is not None else 0.0 for t in uncond]
            scores.append(_mean([float(c[0]) - ui for c, ui in zip(cond, u)]))
        meta["unconditional_token_logprobs"] = unconditional
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return _argmax_first(scores), scores


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def sample_index(scores: list[float], temperature: float, rand: float) -> int:
    """Index drawn from softmax(scores / temperature) given a uniform `rand` in [0, 1)."""
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    total = sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w / total
        if rand < acc:
            return i
    return len(scores) - 1
