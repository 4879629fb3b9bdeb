"""Batched next-token sampling: penalties, greedy, temperature, min-p / top-k / top-p, seeds,
logprobs.

Order of operations (vLLM):

1. ``logit_bias`` is added; ``vocab_mask`` (grammar) and ``suppress_token_ids``
   (``min_new_tokens``) set banned logits to ``-inf``;
2. repetition (prompt + output tokens), frequency and presence (output tokens) penalties;
3. greedy rows take the argmax of these logits;
4. the other rows: divide by temperature, drop tokens below ``min_p * max_prob``, then keep the
   ``top_k`` most likely and, of those (renormalized), the smallest prefix whose probability
   reaches ``top_p``; sample from what is left.

Invariants:

- The same logits row, sampling params and seeded generator give the same token whatever the
  other rows of the batch are: every op is row-wise, every per-row decision (including which
  top-k candidate width to use) depends on that row only, and each row draws one uniform number
  from its own generator (inverse-CDF sampling in vocabulary order).
- ``logprobs`` are those of the *raw* model distribution (``log_softmax`` of the unmodified
  logits), like vLLM's default ``raw_logprobs``.
- The caller's ``logits`` tensor is never modified.
- Every row must leave at least one token allowed (``vocab_mask`` / suppressed ids).
- ``redraw`` on a kept row (``keep=True``) is the same draw as the sampler's on that row's
  logits with the removed tokens at -inf (one uniform from the row's generator, as a sample),
  without a second pass of the sampler: the verifier's resampling loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from radixlm.runtime.sampling_batch import SamplingBatchInfo, make_generator

# Top-k / top-p try these candidate widths (torch.topk) before a full sort of the vocabulary.
CANDIDATE_WIDTHS = (64, 1024)
# A redraw from kept probabilities needs this much mass left; below it, tokens whose probability
# underflowed to 0 could matter, and the sampler draws from the logits instead.
_MIN_REDRAW_MASS = 1e-4
# Tokens per block of a redraw's block sums (``RowDraw.sums``): ``kRedrawBlock`` of
# ``sampling_ops.cpp``, which checks the length it is given.
REDRAW_BLOCK = 256


@dataclass
class SampleOutput:
    """Sampled tokens; ``logprobs[i]`` / ``top_logprobs[i]`` are None for rows that did not ask.
    Both lists are None when no row asked for logprobs."""

    next_token_ids: list[int]  # [B]
    logprobs: list[float | None] | None = None  # [B]
    top_logprobs: list[list[tuple[int, float]] | None] | None = None  # [B][k], descending
    # With ``keep=True``: per row whose redraw needs no second pass of the sampler (see
    # ``RowDraw``), what it was drawn from; ``Sampler.redraw`` draws again with tokens removed.
    kept: dict[int, RowDraw] | None = None


@dataclass
class RowDraw:
    """What one row's token was drawn from, kept for redraws (``Sampler.redraw``).

    ``greedy``: ``values`` are the row's scores after bias and penalties (the token was their
    argmax); else ``values`` are its probabilities, at any positive scale (temperature
    applied, no min-p / top-k / top-p on the row: those filters depend on which tokens remain,
    so a row with one is not kept). Either way, removing tokens from ``values`` and drawing
    again is exactly the sampler's draw on the row's logits with those tokens at -inf.
    """

    greedy: bool
    values: Tensor  # [V] float32 (greedy: may alias the caller's logits row)
    # A sampled row's block sums of ``values`` (float64 [ceil(V / 256)]) as the CPU op's draw or
    # last redraw left them: the next redraw given the tokens removed since sums only their blocks.
    sums: Tensor | None = None


def apply_penalties(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """vLLM penalties, out of place. Repetition applies to prompt and output tokens (divide
    positive logits, multiply the others); frequency subtracts ``f * count`` and presence
    subtracts ``p * [count > 0]``, both over output tokens only."""
    rows, toks, counts = info.penalty_rows, info.penalty_tokens, info.penalty_counts
    assert rows is not None and toks is not None and counts is not None
    assert info.repetition_penalties is not None
    assert info.frequency_penalties is not None and info.presence_penalties is not None
    vals = logits[rows, toks]  # [N]
    rep = info.repetition_penalties[rows]  # [N]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals = vals - info.frequency_penalties[rows] * counts
    vals = vals - info.presence_penalties[rows] * (counts > 0).to(vals.dtype)
    return logits.index_put((rows, toks), vals)


def apply_min_p(logits: Tensor, min_ps: Tensor) -> Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_ps[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, -torch.inf)


def _keep_in_candidates(
    x: Tensor, width: int, top_ks: Tensor, top_ps: Tensor
) -> tuple[Tensor, Tensor]:
    """Top-k then top-p over the ``width`` most likely tokens of each row of ``x`` ``[R, V]``.
    Returns (keep ``[R, V]`` bool, covered ``[R]`` bool): a row is covered when tokens outside
    the candidates are certainly dropped, i.e. its kept set is exact."""
    vocab = x.shape[-1]
    if width < vocab:
        vals, idx = x.topk(width, dim=-1)  # [R, W], sorted descending
    else:
        vals, idx = x.sort(dim=-1, descending=True, stable=True)  # [R, V]
    probs = (vals - x.logsumexp(dim=-1, keepdim=True)).exp()  # [R, W] of the full distribution
    ranks = torch.arange(vals.shape[-1], device=x.device)  # [W]
    drop = ranks[None, :] >= top_ks[:, None]  # [R, W]
    kept = probs.masked_fill(drop, 0.0)
    mass = kept.sum(dim=-1)  # [R] probability of the top-k tokens among the candidates
    k_inside = top_ks <= width  # [R] else top-k is disabled or wider than the candidates
    norm = torch.where(k_inside, mass, 1.0)  # [R] mass of the top-k set when it is known
    before = (kept.cumsum(dim=-1) - kept) / norm[:, None]  # [R, W] exclusive cumulative prob
    top_p = torch.where(top_ps < 1.0, top_ps, torch.inf)  # [R]
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    # Without top-k (top_k == vocab) the top-p prefix is inside once the candidates' mass
    # reaches top_p; a top-k wider than the candidates needs its full mass: not covered.
    covered = k_inside | ((top_ks >= vocab) & (mass >= top_p)) | (width >= vocab)  # [R]
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, idx, ~drop)  # [R, V]
    return keep, covered


def apply_top_k_top_p(
    logits: Tensor, top_ks: Tensor, top_ps: Tensor, top_k_list: list[int], top_p_list: list[float]
) -> Tensor:
    """Keep the ``top_k`` most likely tokens, then the smallest prefix of those (renormalized)
    whose probability reaches ``top_p``; the top token always survives. Candidates come from
    ``torch.topk`` at growing widths (``CANDIDATE_WIDTHS``) and a full sort only for rows
    whose kept set is not inside them; the result equals a full sort's."""
    vocab = logits.shape[-1]
    pending = [
        i for i, (k, p) in enumerate(zip(top_k_list, top_p_list, strict=True)) if k < vocab or p < 1
    ]
    keep = torch.ones_like(logits, dtype=torch.bool)  # [B, V]
    for width in (*[w for w in CANDIDATE_WIDTHS if w < vocab], vocab):
        if not pending:
            break
        if len(pending) == len(top_k_list):
            keep, covered = _keep_in_candidates(logits, width, top_ks, top_ps)
        else:
            rows = torch.tensor(pending, device=logits.device)  # [R]
            sub = _keep_in_candidates(logits[rows], width, top_ks[rows], top_ps[rows])
            keep[rows], covered = sub
        pending = [i for i, c in zip(pending, covered.tolist(), strict=True) if not c]
    return logits.masked_fill(~keep, -torch.inf)


def _cpu_op(x: Tensor):  # noqa: ANN202 - the compiled ops' namespace, or None
    """The compiled CPU ops when ``x`` (float32 / bf16) is on the CPU and they built."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    from radixlm.kernels.cpu.build import load_op

    return load_op()


def argmax_rows(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` for ``x`` ``[B, V]``: on CPU (float32 / bf16, rows contiguous) the
    compiled op (``sampling_ops.cpp``: torch's result, ~50x faster for 8 bf16 rows of a 49k
    vocabulary), else torch's."""
    if x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] > 0:
        op = _cpu_op(x)
        if op is not None:
            return op.argmax_rows(x)
    return x.argmax(dim=-1)


def pick(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: per row of ``probs`` ``[R, V]`` (non-negative, any positive sum)
    the token where the cumulative mass first exceeds ``u * total`` (``u`` ``[R]`` in [0, 1));
    never a zero-probability token."""
    cdf = probs.cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1:]  # [R, 1]
    picked = torch.searchsorted(cdf, u[:, None] * total, right=True)  # [R, 1]
    # NOTE: rounding can put u * total at total; the last positive-probability token is the
    # first index where the cdf reaches its total.
    last = (cdf < total).sum(dim=-1, keepdim=True)  # [R, 1]
    return torch.minimum(picked, last).squeeze(1)


def filter_logits(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """min-p, then top-k / top-p, for every row of ``logits`` ``[B, V]`` (already divided by
    the temperature); filtered tokens become -inf. The sampler does the same on its rows."""
    if info.need_min_p:
        logits = apply_min_p(logits, info.min_ps)
    if info.need_top_k_top_p:
        logits = apply_top_k_top_p(
            logits, info.top_ks, info.top_ps, info.top_k_list, info.top_p_list
        )
    return logits


class Sampler:
    """Batched sampler; stateless except for the optional default generator.

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
        self,
        logits: Tensor,
        info: SamplingBatchInfo,
        vocab_mask: Tensor | None = None,
        raw_logits: Tensor | None = None,
        keep: bool = False,
    ) -> SampleOutput:
        """Sample one token per row. ``logits`` is ``[B, V]`` of any float dtype (computed in
        float32). ``vocab_mask`` is an optional bool ``[B, V]`` allow-list (True = allowed),
        e.g. a grammar bitmask unpacked by the caller. ``raw_logits``: the model's logits when
        the caller already masked ``logits`` in place (grammar bitmask); logprobs come from them.
        ``keep``: fill ``SampleOutput.kept`` (the rows a redraw may take without the sampler).
        """
        if info.all_greedy and not info.need_penalties and not info.need_logprobs:
            # Hot path: argmax is exact in the input dtype; no float32 copy, no sort.
            x = self._mask(logits, info, vocab_mask)
            out = SampleOutput(next_token_ids=argmax_rows(x).tolist())
            if keep:
                out.kept = {i: RowDraw(True, x[i]) for i in range(info.batch_size)}
            return out

        raw = logits.float()  # [B, V]; may alias the caller's tensor: ops below are out of place
        x = self._mask(raw, info, vocab_mask)
        if raw_logits is not None:
            raw = raw_logits.float()  # [B, V]
        if info.need_penalties:
            x = apply_penalties(x, info)
        rows = [i for i, g in enumerate(info.is_greedy) if not g]
        probs = sums = None
        if not rows:
            next_ids = argmax_rows(x)  # [B]
        elif len(rows) == info.batch_size:
            next_ids, probs, sums = self._sample(x, info, rows, keep)
        else:
            next_ids = argmax_rows(x)
            idx = torch.tensor(rows, device=x.device)  # [R]
            next_ids[idx], probs, sums = self._sample(x[idx], info, rows, keep)
        out = self.with_logprobs(raw, next_ids, info)
        if keep:
            out.kept = {i: RowDraw(True, x[i]) for i, g in enumerate(info.is_greedy) if g}
            assert probs is not None or not rows
            vocab = x.shape[-1]
            for j, i in enumerate(rows):
                ks, ps, mins = info.top_k_list[i], info.top_p_list[i], info.min_p_list[i]
                if ks >= vocab and ps >= 1 and mins <= 0:  # no filter on the row
                    row_sums = None if sums is None else sums[j]
                    out.kept[i] = RowDraw(False, probs[j], row_sums)  # type: ignore[index]
        return out

    def redraw(
        self,
        row: RowDraw,
        logits: Tensor,
        generator: torch.Generator | None,
        removed: list[int] | None = None,
    ) -> int | None:
        """A fresh draw for a kept row with the tokens where ``logits`` ``[V]`` (the row's
        masked logits) is -inf taken out: the same as the sampler's draw on ``logits``, without
        a second pass of the sampler; ``row`` keeps them out (in place) for the next redraw.
        A sampled row draws one uniform from ``generator`` (else the shared default). None
        when the row cannot tell exactly (no score left, or under ``_MIN_REDRAW_MASS`` of
        probability, where tokens whose probability underflowed to 0 would matter): the caller
        runs the sampler instead. On CPU a compiled op (``sampling_ops.cpp``), else torch.
        ``removed``: the tokens set to -inf in ``logits`` since this row's last redraw (all of
        them, when there was one): a sampled row then sums again only their blocks of the
        row, not the whole row (the same token, bit for bit)."""
        if row.values.dtype != torch.float32:
            row.values = row.values.float()  # [V] (a greedy row's bf16 logits)
        u = 0.0 if row.greedy else float(self._uniform(generator, row.values.device))
        op = _cpu_op(row.values)
        if op is not None and logits.is_contiguous():
            if row.sums is not None and removed is not None:
                ids = torch.tensor(removed, dtype=torch.long)
                tok = op.redraw_removed_(row.values, row.sums, ids, u, _MIN_REDRAW_MASS)
            else:
                if not row.greedy:
                    nb = -(-row.values.shape[0] // REDRAW_BLOCK)
                    row.sums = torch.empty(nb, dtype=torch.float64)
                tok = op.redraw_row_(row.values, logits, row.greedy, u, _MIN_REDRAW_MASS, row.sums)
            return None if tok < 0 else tok
        removed = torch.isneginf(logits)  # [V]
        if row.greedy:
            row.values = row.values.masked_fill(removed, -torch.inf)  # [V]
            best = argmax_rows(row.values[None])  # [1]
            return None if row.values[best].isneginf().item() else int(best)
        p = row.values.masked_fill_(removed, 0.0)  # [V]
        if float(p.sum()) < _MIN_REDRAW_MASS:
            return None
        return int(pick(p[None], torch.tensor([u], device=p.device))[0])

    @staticmethod
    def _mask(x: Tensor, info: SamplingBatchInfo, vocab_mask: Tensor | None) -> Tensor:
        """Out of place: ``logit_bias`` is added, then disallowed (``vocab_mask``) and
        suppressed tokens become -inf."""
        if info.bias_rows is not None:
            assert info.bias_tokens is not None and info.bias_values is not None
            values = info.bias_values.to(x.dtype)
            x = x.index_put((info.bias_rows, info.bias_tokens), values, accumulate=True)
        if vocab_mask is not None:
            x = x.masked_fill(~vocab_mask, -torch.inf)  # [B, V]
        if info.suppress_token_ids is not None:
            supp = info.suppress_token_ids
            rows = torch.tensor([i for i, ids in enumerate(supp) for _ in ids], device=x.device)
            cols = torch.tensor([t for ids in supp for t in ids], device=x.device)
            x = x.index_put((rows, cols), torch.tensor(-torch.inf, dtype=x.dtype, device=x.device))
        return x

    def _sample(
        self, x: Tensor, info: SamplingBatchInfo, rows: list[int], keep: bool = False
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Sample rows ``rows`` of the batch; ``x`` ``[R, V]`` holds exactly those rows.
        Returns the tokens ``[R]``, the probabilities they were drawn from ``[R, V]`` (those
        of a row with a filter unnormalized: only ``keep`` reads them, for unfiltered rows) and,
        with ``keep`` on the compiled op, their block sums ``[R, ceil(V / REDRAW_BLOCK)]``
        float64 (``RowDraw.sums``: a first redraw then sums only the removed tokens' blocks)."""
        idx = torch.tensor(rows, device=x.device) if len(rows) < info.batch_size else None

        def sel(t: Tensor) -> Tensor:
            return t if idx is None else t[idx]

        op = _cpu_op(x)
        if op is not None and x.dtype == torch.float32 and x.stride(-1) == 1:
            # The compiled op (torch's ops below are its twin), the same uniforms in the same
            # order: a few passes over a row, no sort of the vocabulary.
            probs = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # [R, V]
            filters = [sel(t).contiguous() for t in (info.top_ks, info.top_ps, info.min_ps)]
            temps = sel(info.temperatures).contiguous()  # [R]
            u = self._uniforms(info, rows, x.device)  # [R]
            sums = None
            if keep:
                nb = -(-x.shape[-1] // REDRAW_BLOCK)
                sums = torch.empty(x.shape[0], nb, dtype=torch.float64)  # [R, nb]
            tokens = op.sample_rows(x, temps, *filters, u, probs, sums)  # [R]; -1: none allowed
            if not bool((tokens < 0).any()):
                return tokens, probs, sums
            # A row with nothing allowed (the callers' invariant broken, or NaN logits): the
            # torch ops, as without the compiled op, rather than an error for the whole batch.
        x = x / sel(info.temperatures)[:, None]  # [R, V]
        if info.need_min_p:
            x = apply_min_p(x, sel(info.min_ps))
        if info.need_top_k_top_p:
            ks = [info.top_k_list[i] for i in rows]
            ps = [info.top_p_list[i] for i in rows]
            x = apply_top_k_top_p(x, sel(info.top_ks), sel(info.top_ps), ks, ps)
        probs = x.softmax(dim=-1)  # [R, V]
        return pick(probs, self._uniforms(info, rows, x.device)), probs, None

    def probs(self, logits: Tensor, info: SamplingBatchInfo) -> Tensor:
        """The distribution each row's token is drawn from, ``[B, V]`` float32: bias, masks,
        penalties, then for sampled rows temperature, min-p, top-k / top-p and softmax; a
        greedy row is one-hot at its argmax. (Speculative decoding's acceptance reads it.)"""
        x = self._mask(logits.float(), info, None)
        if info.need_penalties:
            x = apply_penalties(x, info)
        out = torch.zeros_like(x).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)  # [B, V]
        rows = [i for i, g in enumerate(info.is_greedy) if not g]
        if rows:
            idx = torch.tensor(rows, device=x.device)  # [R]
            y = x[idx] / info.temperatures[idx][:, None]  # [R, V]
            if info.need_min_p:
                y = apply_min_p(y, info.min_ps[idx])
            if info.need_top_k_top_p:
                ks = [info.top_k_list[i] for i in rows]
                ps = [info.top_p_list[i] for i in rows]
                y = apply_top_k_top_p(y, info.top_ks[idx], info.top_ps[idx], ks, ps)
            out[idx] = y.softmax(dim=-1)
        return out

    def uniforms(self, info: SamplingBatchInfo) -> Tensor:
        """One U[0, 1) per row of ``info`` (seeded rows from their own generator)."""
        return self._uniforms(info, list(range(info.batch_size)), info.device)

    def _uniforms(self, info: SamplingBatchInfo, rows: list[int], device: torch.device) -> Tensor:
        """One U[0, 1) per sampled row: seeded rows from their own generator, the others from
        the shared default, so a seeded row's draw never depends on the rest of the batch."""
        u = torch.empty(len(rows), dtype=torch.float32, device=device)  # [R]
        shared = [j for j, i in enumerate(rows) if info.generators[i] is None]
        if shared:
            gen = self._default_generator(device)
            u[shared] = torch.rand(len(shared), generator=gen, device=device)
        for j, i in enumerate(rows):
            gen = info.generators[i]
            if gen is not None:
                u[j] = self._uniform(gen, device)[0]
        return u

    def _uniform(self, generator: torch.Generator | None, device: torch.device) -> Tensor:
        """One U[0, 1) ``[1]`` from ``generator`` (a CPU generator works with device logits
        too), else from the shared default."""
        if generator is None:
            return torch.rand(1, generator=self._default_generator(device), device=device)
        return torch.rand(1, generator=generator, device=generator.device).to(device)

    @staticmethod
    def with_logprobs(raw: Tensor, next_ids: Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """``next_ids`` ``[B]`` with the raw model's logprobs (and top logprobs) where asked."""
        if not info.need_logprobs:
            return SampleOutput(next_token_ids=next_ids.tolist())
        logp = raw.log_softmax(dim=-1)  # [B, V]
        chosen = logp.gather(1, next_ids[:, None]).squeeze(1)  # [B]
        k = max(info.top_logprobs)
        ids_l, chosen_l = next_ids.tolist(), chosen.tolist()
        top_vals: list[list[float]] = [[] for _ in ids_l]
        top_ids: list[list[int]] = [[] for _ in ids_l]
        if k > 0:
            vals, tids = logp.topk(k, dim=-1)  # [B, k], descending
            top_vals, top_ids = vals.tolist(), tids.tolist()
        logprobs: list[float | None] = []
        tops: list[list[tuple[int, float]] | None] = []
        for i, want in enumerate(info.logprobs):
            n = info.top_logprobs[i]
            logprobs.append(chosen_l[i] if want else None)
            tops.append(list(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if want else None)
        return SampleOutput(next_token_ids=ids_l, logprobs=logprobs, top_logprobs=tops)
