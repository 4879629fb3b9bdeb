"""A step's sampling state for a batch of rows (``SamplingBatchInfo``), built once per step from
the requests' ``SamplingParams``, and the per-request pieces it is built from: seeded generators
(``make_generator``) and the ``min_new_tokens`` suppressions (``min_tokens_suppress_ids``).
The sampler (``runtime/sampler.py``) reads it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from radixlm.runtime.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; the scheduler keeps it across the request's steps. The sampler
    draws one number per step from it, so a CPU generator is cheap even for GPU logits and
    makes a seed give the same tokens on every device type (given the same logits)."""
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


def _lazy_tensor(source: str, dtype: torch.dtype) -> cached_property:
    """A ``SamplingBatchInfo`` tensor built from its host list ``source`` on first read."""

    def build(info: SamplingBatchInfo) -> Tensor:
        return torch.tensor(getattr(info, source), dtype=dtype, device=info.device)

    return cached_property(build)


@dataclass
class SamplingBatchInfo:
    """Per-step sampling state for a batch of ``B`` rows, built from CPU lists once per step.

    Disabled filters hold neutral values: ``top_ks == vocab_size``, ``top_ps == 1``,
    ``min_ps == 0``; greedy rows hold ``temperatures == 1`` (they are argmaxed, never divided).
    Penalties are sparse: one entry per distinct (row, token) seen in the row's prompt or output,
    for rows that need penalties. Python-side lists and flags let the sampler choose its path
    without reading tensors back.
    """

    temperature_list: list[float]  # [B]; the tensors below are built on first read
    device: torch.device
    is_greedy: list[bool]
    generators: list[torch.Generator | None]
    logprobs: list[bool]
    top_logprobs: list[int]
    top_k_list: list[int]  # == top_ks, on the CPU
    top_p_list: list[float]  # == top_ps, on the CPU
    min_p_list: list[float]  # == min_ps, on the CPU
    suppress_token_ids: list[list[int]] | None = None
    # Sparse logit bias: logits[bias_rows[j], bias_tokens[j]] += bias_values[j].
    bias_rows: Tensor | None = None  # [N] int64
    bias_tokens: Tensor | None = None  # [N] int64
    bias_values: Tensor | None = None  # [N] float32
    repetition_penalties: Tensor | None = None  # [B] float32, None unless a row needs penalties
    frequency_penalties: Tensor | None = None  # [B] float32
    presence_penalties: Tensor | None = None  # [B] float32
    penalty_rows: Tensor | None = None  # [N] int64
    penalty_tokens: Tensor | None = None  # [N] int64, distinct per row
    penalty_counts: Tensor | None = None  # [N] float32, occurrences in the output (0: prompt only)
    need_min_p: bool = False
    need_top_k_top_p: bool = False
    all_greedy: bool = field(init=False)
    need_logprobs: bool = field(init=False)

    def __post_init__(self) -> None:
        self.all_greedy = all(self.is_greedy)
        self.need_logprobs = any(self.logprobs)

    # The per-row filter tensors, built when the sampler first reads them: an all-greedy step
    # (argmax only) never does, and four small tensors cost ~60 us of a CPU decode step.
    temperatures = _lazy_tensor("temperature_list", torch.float32)  # [B]
    top_ks = _lazy_tensor("top_k_list", torch.int64)  # [B]
    top_ps = _lazy_tensor("top_p_list", torch.float32)  # [B]
    min_ps = _lazy_tensor("min_p_list", torch.float32)  # [B]

    @property
    def need_penalties(self) -> bool:
        return self.penalty_rows is not None

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
        (see ``min_tokens_suppress_ids``). ``prompt_ids`` / ``output_ids`` are only read for
        rows that need penalties; the engine passes the request's prompt token set and output
        ``Counter`` (kept incrementally), so a step never recounts a whole output.
        ``vocab_size`` is the logits width."""
        batch = len(params)
        if not (len(generators) == len(prompt_ids) == len(output_ids) == batch):
            raise ValueError("params, generators, prompt_ids and output_ids must have equal length")
        if suppress_token_ids is not None and len(suppress_token_ids) != batch:
            raise ValueError("suppress_token_ids must have one entry per row")
        device = torch.device(device)

        def f32(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)  # [B]

        sampled = [p for p in params if not p.is_greedy]  # the filters only matter for these
        top_ks = [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params]
        top_ps = [p.top_p for p in params]
        info = cls(
            temperature_list=[1.0 if p.is_greedy else p.temperature for p in params],
            device=device,
            is_greedy=[p.is_greedy for p in params],
            generators=list(generators),
            logprobs=[p.logprobs for p in params],
            top_logprobs=[p.top_logprobs for p in params],
            top_k_list=top_ks,
            top_p_list=top_ps,
            min_p_list=[p.min_p for p in params],
            suppress_token_ids=(
                [list(s) for s in suppress_token_ids]
                if suppress_token_ids is not None and any(suppress_token_ids)
                else None
            ),
            need_min_p=any(p.min_p > 0 for p in sampled),
            need_top_k_top_p=any(0 < p.top_k < vocab_size or p.top_p < 1 for p in sampled),
        )
        if any(p.needs_penalties for p in params):
            info._set_penalties(params, prompt_ids, output_ids, device)
        if any(p.logit_bias for p in params):
            pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
            info.bias_rows = torch.tensor(
                [r for r, _, _ in pairs], dtype=torch.int64, device=device
            )
            info.bias_tokens = torch.tensor(
                [t for _, t, _ in pairs], dtype=torch.int64, device=device
            )
            info.bias_values = f32([b for _, _, b in pairs])
        return info

    def _set_penalties(
        self,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        device: torch.device,
    ) -> None:
        rows: list[int] = []
        tokens: list[int] = []
        counts: list[int] = []
        for i, p in enumerate(params):
            if not p.needs_penalties:
                continue
            ids = output_ids[i]
            out = ids if isinstance(ids, Counter) else Counter(ids)
            prompt_only = frozenset(prompt_ids[i]).difference(out)
            rows.extend([i] * (len(out) + len(prompt_only)))
            tokens.extend(out.keys())
            tokens.extend(prompt_only)
            counts.extend(out.values())
            counts.extend([0] * len(prompt_only))

        def f32(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        self.repetition_penalties = f32([p.repetition_penalty for p in params])
        self.frequency_penalties = f32([p.frequency_penalty for p in params])
        self.presence_penalties = f32([p.presence_penalty for p in params])
        self.penalty_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.penalty_tokens = torch.tensor(tokens, dtype=torch.int64, device=device)
        self.penalty_counts = f32(counts)
