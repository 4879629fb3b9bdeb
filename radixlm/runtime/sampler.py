"""Batched next-token sampling: penalties, greedy, temperature, min-p / top-k / top-p, seeds,
logprobs.

Order of operations (vLLM):

1. ``vocab_mask`` (grammar) and ``suppress_token_ids`` (``min_new_tokens``) set banned logits to
   ``-inf``;
2. repetition (prompt + output tokens), frequency and presence (output tokens) penalties;
3. greedy rows take the argmax of these logits;
4. the other rows: divide by temperature, then filter min-p (relative to the top probability),
   top-k, and top-p (over the probabilities renormalized after min-p and top-k), then sample.

Invariants:

- The same logits row, sampling params and seeded generator give the same token whatever the
  other rows of the batch are: every op is row-wise and sampling happens in vocabulary order.
- ``logprobs`` are those of the *raw* model distribution (``log_softmax`` of the unmodified
  logits), like vLLM's default ``raw_logprobs``.
- The caller's ``logits`` tensor is never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from radixlm.runtime.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; the scheduler keeps it across the request's steps."""
    return torch.Generator(device=device).manual_seed(seed)


def min_tokens_suppress_ids(
    params: SamplingParams, eos_token_ids: Sequence[int], num_output_tokens: int
) -> list[int]:
    """Ids to ban for the next token while fewer than ``min_new_tokens`` have been generated:
    the stop token ids, plus EOS unless ``ignore_eos`` (vLLM ``min_tokens``)."""
    if num_output_tokens >= params.min_new_tokens:
        return []
    eos = [] if params.ignore_eos else [t for t in eos_token_ids if t not in params.stop_token_ids]
    return [*params.stop_token_ids, *eos]


def _count_tokens(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """Per-row token counts as a dense ``[B, V]`` float32 tensor (one scatter_add)."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)  # [B, V]
    lengths = [len(r) for r in rows]
    if sum(lengths) == 0:
        return counts
    flat = [t for r in rows for t in r]
    ids = torch.tensor(flat, dtype=torch.int64, device=device)  # [T]
    row_idx = torch.repeat_interleave(
        torch.arange(len(rows), device=device), torch.tensor(lengths, device=device)
    )  # [T]
    counts.view(-1).index_add_(
        0, row_idx * vocab_size + ids, torch.ones_like(ids, dtype=counts.dtype)
    )
    return counts


@dataclass
class SamplingBatchInfo:
    """Per-step sampling state for a batch of ``B`` rows, built on CPU lists once per step.

    Disabled filters hold neutral values: ``top_ks == vocab_size``, ``top_ps == 1``,
    ``min_ps == 0``; greedy rows hold ``temperatures == 1`` (they are argmaxed, never divided).
    The ``need_*`` flags are computed on the CPU so the sampler never syncs to decide a path.
    """

    temperatures: Tensor  # [B] float32
    top_ks: Tensor  # [B] int64
    top_ps: Tensor  # [B] float32
    min_ps: Tensor  # [B] float32
    is_greedy: list[bool]
    generators: list[torch.Generator | None]
    logprobs: list[bool]
    top_logprobs: list[int]
    suppress_token_ids: list[list[int]] | None = None
    # Penalties: all None unless some row needs them.
    repetition_penalties: Tensor | None = None  # [B] float32
    frequency_penalties: Tensor | None = None  # [B] float32
    presence_penalties: Tensor | None = None  # [B] float32
    output_counts: Tensor | None = None  # [B, V] float32, counts of generated tokens
    prompt_mask: Tensor | None = None  # [B, V] bool, token occurs in the prompt
    need_min_p: bool = False
    need_top_k: bool = False
    need_top_p: bool = False
    all_greedy: bool = field(init=False)
    need_logprobs: bool = field(init=False)

    def __post_init__(self) -> None:
        self.all_greedy = all(self.is_greedy)
        self.need_logprobs = any(self.logprobs)

    @property
    def need_penalties(self) -> bool:
        return self.repetition_penalties is not None

    @property
    def batch_size(self) -> int:
        return len(self.is_greedy)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        suppress_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatchInfo:
        """Build the batch state. ``suppress_token_ids[i]`` are banned for row ``i`` this step
        (the scheduler passes EOS / stop ids while the output is shorter than min_new_tokens).
        ``prompt_ids`` / ``output_ids`` are only read when some row needs penalties."""
        batch = len(params)
        if not (len(generators) == len(prompt_ids) == len(output_ids) == batch):
            raise ValueError("params, generators, prompt_ids and output_ids must have equal length")
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        sampled = [p for p in params if not p.is_greedy]  # the filters only matter for these
        top_ks = [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params]

        def f32(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)  # [B]

        if suppress_token_ids is not None and len(suppress_token_ids) != batch:
            raise ValueError("suppress_token_ids must have one entry per row")
        info = cls(
            temperatures=f32([1.0 if p.is_greedy else p.temperature for p in params]),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=f32([p.top_p for p in params]),
            min_ps=f32([p.min_p for p in params]),
            is_greedy=greedy,
            generators=list(generators),
            logprobs=[p.logprobs for p in params],
            top_logprobs=[p.top_logprobs for p in params],
            suppress_token_ids=(
                [list(s) for s in suppress_token_ids]
                if suppress_token_ids is not None and any(suppress_token_ids)
                else None
            ),
            need_min_p=any(p.min_p > 0 for p in sampled),
            need_top_k=any(0 < p.top_k < vocab_size for p in sampled),
            need_top_p=any(p.top_p < 1 for p in sampled),
        )
        if any(p.needs_penalties for p in params):
            info.repetition_penalties = f32([p.repetition_penalty for p in params])
            info.frequency_penalties = f32([p.frequency_penalty for p in params])
            info.presence_penalties = f32([p.presence_penalty for p in params])
            info.output_counts = _count_tokens(output_ids, vocab_size, device)
            info.prompt_mask = _count_tokens(prompt_ids, vocab_size, device) > 0
        return info


@dataclass
class SampleOutput:
    """Sampled tokens; ``logprobs[i]`` / ``top_logprobs[i]`` are None for rows that did not ask.
    Both lists are None when no row asked for logprobs."""

    next_token_ids: list[int]  # [B]
    logprobs: list[float | None] | None = None  # [B]
    top_logprobs: list[list[tuple[int, float]] | None] | None = None  # [B][k], descending


def apply_penalties(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """vLLM penalties, out of place. Repetition applies to prompt and output tokens (divide
    positive logits, multiply non-positive ones); frequency subtracts ``f * count`` and presence
    subtracts ``p * [count > 0]``, both over output tokens only."""
    assert info.output_counts is not None and info.prompt_mask is not None
    assert info.repetition_penalties is not None
    assert info.frequency_penalties is not None and info.presence_penalties is not None
    counts = info.output_counts  # [B, V]
    seen = info.prompt_mask | (counts > 0)  # [B, V]
    rep = torch.where(seen, info.repetition_penalties[:, None], 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / rep, logits * rep)  # [B, V]
    logits = logits - info.frequency_penalties[:, None] * counts
    return logits - info.presence_penalties[:, None] * (counts > 0).to(logits.dtype)


def filter_logits(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Apply min-p, top-k and top-p (in that order) with one sort; banned logits become -inf.
    The top token always survives. ``logits`` are already temperature-scaled."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    drop = torch.zeros_like(probs, dtype=torch.bool)  # [B, V]
    if info.need_min_p:
        drop |= probs < info.min_ps[:, None] * probs[:, :1]
    if info.need_top_k:
        ranks = torch.arange(probs.shape[-1], device=probs.device)  # [V]
        drop |= ranks[None, :] >= info.top_ks[:, None]
    if info.need_top_p:
        kept = probs.masked_fill(drop, 0.0)  # [B, V]
        kept = kept / kept.sum(dim=-1, keepdim=True)
        before = kept.cumsum(dim=-1) - kept  # [B, V] exclusive cumulative probability
        top_p = torch.where(info.top_ps < 1.0, info.top_ps, torch.inf)  # [B]
        drop |= before >= top_p[:, None]
    drop[:, 0] = False
    drop_vocab = torch.empty_like(drop).scatter_(1, sorted_idx, drop)  # [B, V] in vocab order
    return logits.masked_fill(drop_vocab, -torch.inf)


class Sampler:
    """Stateless batched sampler (except for the optional default generator).

    ``seed`` seeds a sampler-owned generator used for rows without their own generator;
    without it those rows use torch's global RNG.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._default_gens: dict[torch.device, torch.Generator] = {}

    def _default_generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        gen = self._default_gens.get(device)
        if gen is None:
            gen = self._default_gens[device] = make_generator(self._seed, device)
        return gen

    def __call__(
        self, logits: Tensor, info: SamplingBatchInfo, vocab_mask: Tensor | None = None
    ) -> SampleOutput:
        """Sample one token per row. ``logits`` is ``[B, V]`` of any float dtype (computed in
        float32). ``vocab_mask`` is an optional bool ``[B, V]`` allow-list (True = allowed),
        e.g. a grammar mask unpacked from a bitmask; a row must allow at least one token."""
        if info.all_greedy and not info.need_penalties and not info.need_logprobs:
            # Hot path: argmax is exact in the input dtype, no float32 copy, no sort.
            x = self._mask(logits, info, vocab_mask)
            return SampleOutput(next_token_ids=x.argmax(dim=-1).tolist())

        raw = logits.float()  # [B, V]; may alias the caller's tensor: ops below are out of place
        x = self._mask(raw, info, vocab_mask)
        if info.need_penalties:
            x = apply_penalties(x, info)
        next_ids = x.argmax(dim=-1)  # [B]
        if not info.all_greedy:
            sampled = self._sample(x, info)  # [B]
            greedy = torch.tensor(info.is_greedy, device=x.device)  # [B]
            next_ids = torch.where(greedy, next_ids, sampled)
        return self._with_logprobs(raw, next_ids, info)

    @staticmethod
    def _mask(x: Tensor, info: SamplingBatchInfo, vocab_mask: Tensor | None) -> Tensor:
        """Out of place: disallowed (``vocab_mask``) and suppressed tokens become -inf."""
        if vocab_mask is not None:
            x = x.masked_fill(~vocab_mask, -torch.inf)  # [B, V]
        if info.suppress_token_ids is not None:
            supp = info.suppress_token_ids
            rows = torch.tensor([i for i, ids in enumerate(supp) for _ in ids], device=x.device)
            cols = torch.tensor([t for ids in supp for t in ids], device=x.device)
            x = x.index_put((rows, cols), torch.tensor(-torch.inf, dtype=x.dtype, device=x.device))
        return x

    def _sample(self, x: Tensor, info: SamplingBatchInfo) -> Tensor:
        x = x / info.temperatures[:, None]  # [B, V]
        if info.need_min_p or info.need_top_k or info.need_top_p:
            x = filter_logits(x, info)
        probs = x.softmax(dim=-1)  # [B, V]
        out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)  # [B]
        shared = [
            i
            for i, (g, greedy) in enumerate(zip(info.generators, info.is_greedy, strict=True))
            if g is None and not greedy
        ]
        if shared:
            idx = torch.tensor(shared, device=probs.device)
            gen = self._default_generator(probs.device)
            out[idx] = torch.multinomial(probs[idx], 1, generator=gen).squeeze(1)
        for i, gen in enumerate(info.generators):
            if gen is not None and not info.is_greedy[i]:
                out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return out

    @staticmethod
    def _with_logprobs(raw: Tensor, next_ids: Tensor, info: SamplingBatchInfo) -> SampleOutput:
        if not info.need_logprobs:
            return SampleOutput(next_token_ids=next_ids.tolist())
        logp = raw.log_softmax(dim=-1)  # [B, V]
        chosen = logp.gather(1, next_ids[:, None]).squeeze(1)  # [B]
        k = max(info.top_logprobs)
        top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (None, None)  # [B, k]
        ids_l, chosen_l = next_ids.tolist(), chosen.tolist()
        vals_l = top_vals.tolist() if top_vals is not None else None
        tids_l = top_ids.tolist() if top_ids is not None else None
        logprobs: list[float | None] = []
        tops: list[list[tuple[int, float]] | None] = []
        for i, want in enumerate(info.logprobs):
            logprobs.append(chosen_l[i] if want else None)
            n = info.top_logprobs[i]
            if want and vals_l is not None and tids_l is not None:
                tops.append(list(zip(tids_l[i][:n], vals_l[i][:n], strict=True)))
            else:
                tops.append([] if want else None)
        return SampleOutput(next_token_ids=ids_l, logprobs=logprobs, top_logprobs=tops)
