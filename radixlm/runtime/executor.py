"""Executor: `run(ScheduledBatch) -> StepOutput`. Forward, logits, grammar masks, sampling and
logprobs of one step; the one place where CPU and GPU differ (CUDA graphs will live here).

The executor reads requests (token ids, pages, params, matchers) but changes none of them: the
scheduler and the output processor own request state. Its own state is the persistent page
table (`PageTable`: a request's row is written once and then only extended, so a decode step
does not rebuild its metadata from Python lists) and the seeded requests' generators.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.batch import SampleError, ScheduledBatch, StepOutput
from radixlm.runtime.constrained import GrammarStep
from radixlm.runtime.request import Request, TokenLogprob
from radixlm.runtime.sampler import RowDraw, Sampler
from radixlm.runtime.sampling_batch import (
    SamplingBatchInfo,
    make_generator,
    min_tokens_suppress_ids,
)
from radixlm.runtime.spec.acceptance import rejection_sample

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    req: Request  # NOTE: a strong reference: `id()` reuse can never alias two requests
    page_gen: int
    synced: int  # entries of req.pages written to the row


class PageTable:
    """A persistent host `[rows, width]` int32 page table, one row per scheduled request.

    A request keeps its row while it is scheduled step after step; new pages are appended to
    the row; a change of earlier pages (`req.page_gen` bumped by the scheduler on adoption or
    release) rewrites the row. Rows of requests missing from a step are recycled.
    """

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.table = torch.zeros((rows, width), dtype=torch.int32)  # [rows, width]
        self._rows: dict[int, int] = {}  # id(req) -> row index
        self._state: list[_Row | None] = [None] * rows

    def rows_for(self, reqs: Sequence[Request]) -> list[int]:
        """Sync and return the row of each request (in order)."""
        live = {id(r) for r in reqs}
        for key in [k for k in self._rows if k not in live]:
            self._state[self._rows.pop(key)] = None
        need = max((len(r.pages) for r in reqs), default=1)
        if need > self.table.shape[1] or len(reqs) > self.table.shape[0]:
            self._grow(max(len(reqs), self.table.shape[0]), max(need, self.table.shape[1]))
        out = []
        for req in reqs:
            idx = self._rows.get(id(req))
            st = self._state[idx] if idx is not None else None
            if st is None or st.req is not req:
                idx = self._state.index(None)
                self._rows[id(req)] = idx
                st = self._state[idx] = _Row(req, req.page_gen, 0)
            if st.page_gen != req.page_gen or st.synced > len(req.pages):
                st.page_gen, st.synced = req.page_gen, 0
            n = len(req.pages)
            if n > st.synced:
                self.table[idx, st.synced : n] = torch.tensor(
                    req.pages[st.synced :], dtype=torch.int32
                )
                st.synced = n
            out.append(idx)
        return out

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        rows = max(rows, old_rows)
        width = old_width if width <= old_width else max(2 * old_width, width)
        new = torch.zeros((rows, width), dtype=torch.int32)
        new[:old_rows, :old_width] = self.table
        self.table = new
        self._state.extend([None] * (rows - len(self._state)))


def build_forward_batch(
    batch: ScheduledBatch, table: PageTable, page_size: int, device: torch.device
) -> tuple[ForwardBatch, list[int], list[range]]:
    """The ragged `ForwardBatch` of `batch`; the logits row of each item's sample (-1: none);
    and each item's prompt-logprob positions (their rows come first, in item order). An item
    with a draft of k tokens has k + 1 consecutive sampling rows, from its sample row on, less
    one per forced draft position (`ScheduledItem.forced`: the row after the token before it
    is not computed)."""
    items = batch.items
    reqs = [i.req for i in items]
    rows = table.rows_for(reqs)
    prefix = [r.num_computed_tokens for r in reqs]
    extend = [i.num_tokens for i in items]
    ids: list[int] = []
    logits_rows: list[int] = []
    sample_row: list[int] = []
    lp_positions: list[range] = []
    offset = 0
    for item, start in zip(items, prefix):
        req = item.req
        ids.extend(req.token_ids[start : start + item.num_known])
        ids.extend(item.draft)
        pos = req.prompt_logprob_positions(start, item.num_known)
        lp_positions.append(pos)
        logits_rows.extend(offset + p - start for p in pos)
        if item.samples:
            # One row after the last known token, then one after each draft token but those
            # before a forced one (nothing is sampled there).
            sample_row.append(len(logits_rows))
            last = offset + item.num_known - 1
            n = len(item.draft)
            logits_rows.extend(last + i for i in range(n + 1) if i == n or i not in item.forced)
        else:
            sample_row.append(-1)
        offset += item.num_tokens
    fb = ForwardBatch.from_parts(
        ids, prefix, extend, table.table.numpy()[rows], logits_rows, page_size, device
    )
    return fb, sample_row, lp_positions


def _one_row_per_sample(batch: ScheduledBatch, sample_row: list[int], fb: ForwardBatch) -> bool:
    """Logits row i is the i-th sample's (no prompt-logprob rows, no drafts) and no
    constrained sample asks for logprobs (those come from the unmasked logits): the grammar's
    masks may go into the logits as the forward makes them (``GrammarStep.fused_mask``)."""
    n = fb.logits_indices.shape[0]
    if len(batch.samples) != n:
        return False
    for i, s in enumerate(batch.samples):
        if sample_row[s.item] != i or (s.req.grammar is not None and s.req.params.logprobs):
            return False
    return True


def row_matchers(reqs: Sequence[Request], prefixes: Sequence[list[int]]) -> list[Any]:
    """The grammar matcher each sampling row is masked by: its request's, or for a row after a
    speculative draft's first tokens, a fork of it advanced through them (the request's own
    matcher is not touched). None for unconstrained rows."""
    out: list[Any] = []
    for req, prefix in zip(reqs, prefixes):
        m = req.grammar
        if m is not None and prefix:
            m = m.fork()
            for t in prefix:
                if not m.accept_token(t):
                    raise RuntimeError(f"draft token {t} is not in the grammar (drafts are walked)")
        out.append(m)
    return out


def masked_rows(
    reqs: Sequence[Request],
    logits: torch.Tensor,
    rows: list[int],
    prefixes: Sequence[list[int]],
    eos_token_ids: Sequence[int],
    grammar: GrammarStep | None,
    loose: bool = False,
) -> tuple[torch.Tensor, list[list[int]], torch.Tensor | None, list[Any] | None]:
    """The rows' logits `[B, V]` with grammar masks applied (a private copy when gathered;
    see the note), the min_tokens suppressions left for the sampler, an unmasked copy for
    logprobs when a constrained row asks (else None), the rows' matchers (None when no row is
    constrained). Row i follows the draft tokens `prefixes[i]`. `loose`: the caller passes
    its samples through `GrammarStep.verify` (`GrammarStep.mask`)."""
    if rows != list(range(logits.shape[0])):
        logits = logits[torch.tensor(rows, device=logits.device)]  # [B, V]
    suppress = [
        min_tokens_suppress_ids(r.params, eos_token_ids, r.num_output_tokens + len(p))
        for r, p in zip(reqs, prefixes)
    ]
    raw, matchers = None, None
    if grammar is not None and any(r.grammar is not None for r in reqs):
        matchers = row_matchers(reqs, prefixes)
        if any(r.grammar is not None and r.params.logprobs for r in reqs):
            raw = logits.clone()  # [B, V] logprobs are the unmasked model's
        # NOTE: masks `logits` in place: it is this step's private tensor (the runner's output
        # or the row gather above), read by nothing else.
        suppress = grammar.mask(matchers, logits, suppress, loose=loose)
    return logits, suppress, raw, matchers


def sampling_info(
    reqs: Sequence[Request],
    suppress: list[list[int]],
    prefixes: Sequence[list[int]],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
) -> SamplingBatchInfo:
    """The sampler's batch state for these rows; row i's output counts (penalties) include
    `prefixes[i]`, the draft tokens before it."""
    params = [r.params for r in reqs]
    needs_hist = any(p.needs_penalties for p in params)
    counts = [
        (r.output_counts + Counter(p) if p else r.output_counts) if needs_hist else ()
        for r, p in zip(reqs, prefixes)
    ]
    return SamplingBatchInfo.build(
        params,
        generators,
        [r.prompt_token_set if needs_hist else () for r in reqs],
        counts,
        vocab_size,
        device,
        suppress_token_ids=suppress,
    )


class Proposer(Protocol):
    """A draft model (`radixlm.runtime.spec.draft_model.DraftModel`): fills the drafts of a
    batch's items that reserved `draft_limit` tokens (`item.draft`, `item.num_tokens`) and
    returns, per item index whose draft was sampled, the draft's distributions `[k, V]` (the
    acceptance is then `rejection_sample`; an item absent is verified by identity)."""

    def propose(self, batch: ScheduledBatch, grammar: GrammarStep | None) -> dict[int, Any]: ...


class Executor:
    """Runs a `ScheduledBatch` on a model runner (`forward(ForwardBatch[, logits_mask])
    -> [R, V]`, `kv_cache.copy_pages`, `device`, `vocab_size`); with a `proposer`, the draft
    model first fills the drafts the scheduler reserved room for."""

    def __init__(
        self,
        runner,
        eos_token_ids: Sequence[int],
        seed: int | None = 0,
        proposer: Proposer | None = None,
    ) -> None:
        self.runner = runner
        self.device: torch.device = runner.device
        self.vocab_size: int = runner.vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler(seed=seed)
        self.grammar: GrammarStep | None = None
        self.proposer = proposer
        self.page_table = PageTable()
        # Seeded requests' generators: sampler state, keyed by request (weakly: a finished
        # request's generator goes with it). The executor changes no request.
        self._generators: weakref.WeakKeyDictionary[Request, torch.Generator] = (
            weakref.WeakKeyDictionary()
        )

    def set_grammar(self, step: GrammarStep) -> None:
        self.grammar = step

    def run(self, batch: ScheduledBatch) -> StepOutput:
        t0 = time.perf_counter()
        draft_probs = self.proposer.propose(batch, self.grammar) if self.proposer else {}
        fb, sample_row, lp_positions = build_forward_batch(
            batch, self.page_table, self.runner.page_size, self.device
        )
        masks = None
        if self.grammar is not None and not any(item.draft for item in batch.items):
            # One row per sample, masked by its request's matcher: filled during the forward.
            self.grammar.prefetch([s.req.grammar for s in batch.samples])
            if _one_row_per_sample(batch, sample_row, fb):
                masks = self.grammar.fused_mask()  # for the LM head to write into the logits
        # [R, V] float32
        logits = self.runner.forward(fb) if masks is None else self.runner.forward(fb, masks)
        if batch.page_copies:
            src, dst = zip(*batch.page_copies)
            self.runner.kv_cache.copy_pages(list(src), list(dst))
        t1 = time.perf_counter()
        prompt_lps, prompt_tops = self._prompt_logprobs(batch, logits, lp_positions)
        # One sampling row per sample, k + 1 for a sample verifying a draft of k tokens: row i
        # samples after the draft's first i tokens (which its penalties / min_tokens count).
        if any(item.draft for item in batch.items):
            token_ids, logprobs, errors, accepted = self._verify(
                batch, logits, sample_row, draft_probs
            )
        else:  # no speculative draft: one row per sample
            rows = [sample_row[s.item] for s in batch.samples]
            reqs = [s.req for s in batch.samples]
            token_ids, logprobs, errors = self._sample_rows(reqs, logits, rows, [[]] * len(rows))
            accepted = {}
        return StepOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            accepted=accepted,
            prompt_logprobs=prompt_lps,
            prompt_top_logprobs=prompt_tops,
            forward_seconds=t1 - t0,
            sample_seconds=time.perf_counter() - t1,
            errors=errors,
        )

    def _verify(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        sample_row: list[int],
        draft_probs: dict[int, torch.Tensor],
    ) -> tuple[
        list[int],
        list[TokenLogprob | None],
        dict[int, SampleError],
        dict[int, tuple[list[int], list[TokenLogprob | None]]],
    ]:
        """Sampling for a batch with speculative drafts: per sample, its token, logprob,
        error, and the draft tokens accepted before the token (`StepOutput` fields)."""
        rows, reqs, prefixes, spans = [], [], [], []
        # sample j with a sampled draft: (accepted, the run emitted, its logprobs)
        sampled: dict[int, tuple[int, list[int], list[TokenLogprob | None]]] = {}
        errors: dict[int, SampleError] = {}
        for j, s in enumerate(batch.samples):
            item = batch.items[s.item]
            draft = item.draft if s.req is item.req else []
            q = draft_probs.get(s.item) if draft else None
            if q is not None:  # a sampled draft: Leviathan / Chen acceptance
                try:
                    sampled[j] = self._accept(s.req, logits, sample_row[s.item], draft, q)
                except Exception as exc:  # noqa: BLE001 - this request only
                    logger.exception("speculative acceptance failed")
                    errors[j] = SampleError(f"internal error in sampling: {exc!r}")
                    sampled[j] = (0, [-1], [None])
                spans.append(({}, draft, frozenset()))
                continue
            forced = item.forced if draft else frozenset()
            # Row i samples the token at draft position i; a forced position has none (nor a
            # logits row: the item's rows are its kept positions in order).
            at: dict[int, int] = {}
            for i in range(len(draft) + 1):
                if i in forced:
                    continue
                rows.append(sample_row[s.item] + len(at))
                at[i] = len(rows) - 1
                reqs.append(s.req)
                prefixes.append(draft[:i])
            spans.append((at, draft, forced))
        toks, lps, row_errors = self._sample_rows(reqs, logits, rows, prefixes)
        token_ids, logprobs, accepted = [], [], {}
        for j, (at, draft, forced) in enumerate(spans):
            if j in sampled:
                a, run_toks, run_lps = sampled[j]
                token_ids.append(run_toks[-1])
                logprobs.append(run_lps[-1])
                accepted[j] = (draft[:a], run_lps[:-1])
                continue
            failed = [row_errors[r] for r in at.values() if r in row_errors]
            if failed:
                errors[j] = failed[0]
            # Rejection sampling for a deterministic draft: sample each row from the target
            # distribution; draft token i stands while it equals row i's sample (a forced one
            # stands: plain decoding appends it unsampled); the first sample that differs (or
            # the one after the whole draft) is the next token.
            a = 0
            while a < len(draft) and (a in forced or toks[at[a]] == draft[a]):
                a += 1
            token_ids.append(toks[at[a]])
            logprobs.append(lps[at[a]])
            if draft:
                accepted[j] = (draft[:a], [None if i in forced else lps[at[i]] for i in range(a)])
        return token_ids, logprobs, errors, accepted

    def _accept(
        self, req: Request, logits: torch.Tensor, row: int, draft: list[int], q: torch.Tensor
    ) -> tuple[int, list[int], list[TokenLogprob | None]]:
        """A draft drawn from `q` `[k, V]`, verified against the target's distributions at
        rows `row .. row + k` (masks, penalties, filters as sampling would apply them) by
        `rejection_sample`: the tokens accepted, then the accepted run plus the token after
        it, with their logprobs (of the raw model)."""
        k = len(draft)
        reqs, prefixes = [req] * (k + 1), [draft[:i] for i in range(k + 1)]
        x, suppress, raw, _ = self._prepare(reqs, logits, list(range(row, row + k + 1)), prefixes)
        info = self._info(reqs, suppress, prefixes, x.device)
        p = self.sampler.probs(x, info)  # [k + 1, V]
        a, tok = rejection_sample(p, q.to(p.device), draft, self.sampler.uniforms(info))
        run = [*draft[:a], tok]
        lps: list[TokenLogprob | None] = [None] * len(run)
        if req.params.logprobs:
            ids = torch.tensor(run + [tok] * (k - a), device=x.device)  # [k + 1]
            out = Sampler.with_logprobs((raw if raw is not None else x).float(), ids, info)
            assert out.logprobs is not None and out.top_logprobs is not None
            lps = [
                TokenLogprob(t, out.logprobs[i], out.top_logprobs[i] or [])
                for i, t in enumerate(run)
            ]
        return a, run, lps

    def _sample_rows(
        self,
        reqs: list[Request],
        logits: torch.Tensor,
        rows: list[int],
        prefixes: list[list[int]],
    ) -> tuple[list[int], list[TokenLogprob | None], dict[int, SampleError]]:
        """`_sample` over all rows; if it raises, row by row, so that only the rows (requests)
        that fail sampling fail."""
        try:
            return self._sample(reqs, logits, rows, prefixes)
        except Exception:  # noqa: BLE001 - find the request(s) that cause it
            logger.exception("batched sampling failed; sampling each request alone")
        toks: list[int] = []
        lps: list[TokenLogprob | None] = []
        errors: dict[int, SampleError] = {}
        for i, req in enumerate(reqs):
            try:
                [tok], [lp], failed = self._sample([req], logits, [rows[i]], [prefixes[i]])
                if failed:
                    errors[i] = failed[0]
            except Exception as exc:  # noqa: BLE001 - this request only
                errors[i] = SampleError(f"internal error in sampling: {exc!r}")
                tok, lp = -1, None
            toks.append(tok)
            lps.append(lp)
        return toks, lps, errors

    def _generator(self, req: Request) -> torch.Generator | None:
        """The request's own generator when it is seeded (branch `index` seeded `seed +
        index`), created at its first sample and advanced by each of its samples."""
        seed = req.params.seed
        if seed is None:
            return None
        gen = self._generators.get(req)
        if gen is None:
            gen = make_generator((seed + req.index) % (1 << 64), self.device)
            self._generators[req] = gen
        return gen

    def probe(self, batch: ScheduledBatch) -> None:
        """Only the forward of `batch` (no sampling, no page copies, nothing recorded): to
        find which request makes a failed step fail. Raises what the forward raises."""
        fb, _, _ = build_forward_batch(batch, self.page_table, self.runner.page_size, self.device)
        self.runner.forward(fb)

    @staticmethod
    def _prompt_logprobs(
        batch: ScheduledBatch, logits: torch.Tensor, positions: list[range]
    ) -> tuple[dict[int, tuple[range, list[float]]], dict[int, list[list[tuple[int, float]]]]]:
        """log p(prompt[p + 1] | prompt[: p + 1]) for the prompt-logprob rows of each item, and
        the top `top_logprobs` (token, logprob) pairs of those rows where the request asks."""
        out: dict[int, tuple[range, list[float]]] = {}
        tops: dict[int, list[list[tuple[int, float]]]] = {}
        row = 0
        for k, (item, pos) in enumerate(zip(batch.items, positions)):
            if len(pos):
                req = item.req
                lp = torch.log_softmax(logits[row : row + len(pos)].float(), dim=-1)  # [n, V]
                targets = torch.tensor(req.token_ids[pos.start + 1 : pos.stop + 1])
                picked = lp.gather(1, targets.to(lp.device)[:, None])[:, 0].tolist()
                out[k] = (pos, picked)
                if req.params.top_logprobs > 0:
                    top = lp.topk(req.params.top_logprobs, dim=-1)  # [n, top_logprobs]
                    tops[k] = [
                        list(zip(ids, vals))
                        for ids, vals in zip(top.indices.tolist(), top.values.tolist())
                    ]
                row += len(pos)
            if item.samples:
                row += 1 + len(item.draft) - len(item.forced)  # its sampling rows
        return out, tops

    def _sample(
        self,
        reqs: list[Request],
        logits: torch.Tensor,
        rows: list[int],
        prefixes: list[list[int]],
    ) -> tuple[list[int], list[TokenLogprob | None], dict[int, SampleError]]:
        """One token per request from `logits[rows[i]]`: grammar masks, min-token suppression,
        penalties, the sampler, the verifier's resampling (`GrammarStep.verify`); logprobs of
        the raw (unmasked) model distribution; the requests that must fail."""
        if not reqs:
            return [], [], {}
        logits, suppress, raw, matchers = self._prepare(reqs, logits, rows, prefixes, loose=True)
        verified = (
            matchers is not None and self.grammar is not None and self.grammar.verifies(matchers)
        )
        tokens, lps, kept = self._draw(reqs, logits, suppress, raw, prefixes, keep=verified)
        errors: dict[int, SampleError] = {}
        if matchers is not None:
            assert self.grammar is not None

            def redraw(i: int, removed: list[int]) -> tuple[int, TokenLogprob | None] | None:
                row = kept.get(i)
                if row is not None and not reqs[i].params.logprobs:
                    tok = self.sampler.redraw(row, logits[i], self._generator(reqs[i]), removed)
                    if tok is not None:
                        return tok, None
                    kept.pop(i)
                if not bool(torch.isfinite(logits[i]).any()):
                    return None  # every token refused: a dead end
                one = slice(i, i + 1)
                row_raw = None if raw is None else raw[one]
                [tok], [lp], _ = self._draw(
                    [reqs[i]], logits[one], [suppress[i]], row_raw, [prefixes[i]]
                )
                return tok, lp

            errors = self.grammar.verify(matchers, logits, tokens, lps, redraw)
        return tokens, lps, errors

    def _prepare(
        self,
        reqs: list[Request],
        logits: torch.Tensor,
        rows: list[int],
        prefixes: list[list[int]],
        loose: bool = False,
    ) -> tuple[torch.Tensor, list[list[int]], torch.Tensor | None, list[Any] | None]:
        return masked_rows(
            reqs, logits, rows, prefixes, self.eos_token_ids, self.grammar, loose=loose
        )

    def _info(
        self,
        reqs: list[Request],
        suppress: list[list[int]],
        prefixes: list[list[int]],
        device: torch.device,
    ) -> SamplingBatchInfo:
        gens = [self._generator(r) for r in reqs]
        return sampling_info(reqs, suppress, prefixes, gens, self.vocab_size, device)

    def _draw(
        self,
        reqs: list[Request],
        logits: torch.Tensor,
        suppress: list[list[int]],
        raw: torch.Tensor | None,
        prefixes: list[list[int]],
        keep: bool = False,
    ) -> tuple[list[int], list[TokenLogprob | None], dict[int, RowDraw]]:
        """The sampler on (masked) ``logits`` ``[len(reqs), V]``; logprobs from ``raw``. Row
        i's output counts (penalties) include ``prefixes[i]``, the draft tokens before it.
        ``keep``: also what the rows were drawn from, for ``Sampler.redraw``."""
        info = self._info(reqs, suppress, prefixes, logits.device)
        out = self.sampler(logits, info, raw_logits=raw, keep=keep)
        lps: list[TokenLogprob | None] = []
        for i, (req, tok) in enumerate(zip(reqs, out.next_token_ids)):
            if req.params.logprobs and out.logprobs is not None:
                top = out.top_logprobs[i] if out.top_logprobs else None
                lps.append(TokenLogprob(tok, out.logprobs[i], top or []))
            else:
                lps.append(None)
        return out.next_token_ids, lps, out.kept or {}
