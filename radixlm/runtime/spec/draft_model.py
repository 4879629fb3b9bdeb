"""A draft model for speculative decoding (`speculative_algorithm="draft"`): a small model
sharing the target's tokenizer (or the target itself with quantized weights) proposes up to
`item.draft_limit` tokens per decoding request, autoregressively, batched across requests,
before the target's forward verifies them.

Its K/V lives in its own buffers (`runner.kv_cache`) with the target's page geometry and is
addressed by the target's page ids (SGLang's EAGLE draft shares `req_to_token` the same way):
a request's draft page table is its `req.pages`, so the draft's pages are allocated, shared by
prefix, copied on fork, trimmed after a rejection and freed with the target's, by the one
`PageManager`; nothing here allocates.

NOTE: invariants
- Every step the draft forwards each item's known tokens (prefill chunks too) from where its
  own K/V of the request ends (`_written`, never past `num_computed_tokens`), so the draft K/V
  of a computed position is that of the request's token there: a page the tree shares carries
  draft K/V as well. Exception: a step of decodes only where nothing drafts runs no draft
  forward (large batches cost nothing extra); those requests catch up when they next draft.
- What the draft reads is never trusted: a stale draft K/V (a page computed before a
  retraction, a rejected draft's slot, a generated page cached while nothing drafted) only
  lowers acceptance; the verification keeps the output exact.
- The draft's proposals are masked like the target's sampling (grammar fork advanced through
  the draft, min_tokens, penalties, bias); the draft stops before a token after which the
  grammar ends or forces text (`draft_token_ok`: jump-forward stays exact) and after a stop /
  EOS token.
- Only `ScheduledItem.draft`, `num_tokens` (drafts added) and this object's own state change;
  no request is touched.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.batch import ScheduledBatch, ScheduledItem
from radixlm.runtime.constrained import GrammarStep
from radixlm.runtime.errors import ConfigError
from radixlm.runtime.executor import PageTable, masked_rows, sampling_info
from radixlm.runtime.grammar.verified import VerifiedMatcher
from radixlm.runtime.request import Request
from radixlm.runtime.sampler import Sampler, pick
from radixlm.runtime.sampling_batch import make_generator
from radixlm.runtime.scheduler.drafter import draft_token_ok

# A seeded request's draft generator: its own stream, apart from the target's sampling.
_DRAFT_SEED_SALT = 0x9E3779B97F4A7C15


def check_same_tokenizer(
    target: Any, draft: Any, target_vocab: int, draft_vocab: int, draft_path: str
) -> None:
    """Refuse a draft model whose tokenizer (token -> id map, special tokens) or logits width
    differs from the target's: its token ids would mean other text."""
    why = None
    if draft_vocab != target_vocab:
        why = f"its vocab_size is {draft_vocab}, the target's {target_vocab}"
    elif draft.get_vocab() != target.get_vocab():
        why = "its tokenizer's vocabulary differs from the target's"
    elif draft.all_special_ids != target.all_special_ids:
        why = "its special tokens differ from the target's"
    if why is not None:
        raise ConfigError(
            f"speculative_draft_model {draft_path!r} cannot draft for this model: {why} "
            "(--speculative-draft-model needs a model sharing the target's tokenizer)"
        )


class DraftModel:
    """Proposes drafts with `runner` (a `ModelRunner` whose KV cache has the target's pages)."""

    def __init__(self, runner: Any, eos_token_ids: list[int], seed: int | None = 0) -> None:
        self.runner = runner
        self.device: torch.device = runner.device
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler(seed=None if seed is None else seed ^ 1)
        self.page_table = PageTable()
        self.num_forwards = 0  # draft forwards run
        # Per request: positions whose draft K/V this model wrote (0 .. n - 1).
        self._written: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._generators: weakref.WeakKeyDictionary[Request, torch.Generator] = (
            weakref.WeakKeyDictionary()
        )

    def written(self, req: Request) -> int:
        """Positions `0 .. n - 1` of `req` whose draft K/V this model computed and that still
        hold the request's tokens (0 when unknown)."""
        return min(self._written.get(req, 0), req.num_computed_tokens)

    def propose(self, batch: ScheduledBatch, grammar: GrammarStep | None) -> dict[int, Any]:
        """Fill the drafts of `batch`'s items with a `draft_limit`; returns per item index the
        draft's distributions `[k, V]` for requests verified by rejection sampling (sampled,
        without a schema verifier); greedy ones are verified by identity."""
        items = batch.items
        for item in items:  # a retried step: drop the drafts of the failed try
            item.num_tokens -= len(item.draft)
            item.draft = []
        if not items:
            return {}
        reqs = [i.req for i in items]
        starts = [
            min(self._written.get(r, r.num_computed_tokens), r.num_computed_tokens) for r in reqs
        ]
        ends = [r.num_computed_tokens + i.num_known for r, i in zip(reqs, items)]
        drafting = [k for k, i in enumerate(items) if i.draft_limit > 0 and i.samples]
        if not drafting and all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            # Decodes only and none drafts (a batch past `speculative_disable_by_batch_size`):
            # no draft forward; each request's draft K/V lags and is caught up when it drafts.
            for req, a in zip(reqs, starts):
                self._written[req] = a
            return {}
        rows = self.page_table.rows_for(reqs)
        ids: list[int] = []
        last_row: dict[int, int] = {}
        for k, (req, a, b) in enumerate(zip(reqs, starts, ends)):
            ids.extend(req.token_ids[a:b])
            last_row[k] = len(ids) - 1
        extend = [b - a for a, b in zip(starts, ends)]
        logits = self._forward(ids, starts, extend, rows, [last_row[k] for k in drafting])
        if batch.page_copies:  # forks' partial pages, written by this forward
            src, dst = zip(*batch.page_copies)
            self.runner.kv_cache.copy_pages(list(src), list(dst))
        for req, b in zip(reqs, ends):
            self._written[req] = b
        drafts: dict[int, list[int]] = {k: [] for k in drafting}
        probs: dict[int, list[torch.Tensor]] = {k: [] for k in drafting}
        forks = {k: reqs[k].grammar.fork() for k in drafting if reqs[k].grammar is not None}
        jump_forward = grammar is not None and grammar.manager.jump_forward_enabled
        active = drafting
        while active:
            toks, q = self._sample(
                [reqs[k] for k in active], logits, [drafts[k] for k in active], grammar
            )
            going = []
            for j, k in enumerate(active):
                fork = forks.get(k)
                if fork is not None and not draft_token_ok(fork, toks[j], jump_forward):
                    continue
                drafts[k].append(toks[j])
                probs[k].append(q[j])
                if len(drafts[k]) < items[k].draft_limit and not self._ends(items[k], toks[j]):
                    going.append(k)
            active = going
            if active:  # the next token's logits: forward each one's last draft token
                pos = [ends[k] + len(drafts[k]) - 1 for k in active]
                logits = self._forward(
                    [drafts[k][-1] for k in active], pos, [1] * len(active),
                    [rows[k] for k in active], list(range(len(active))),
                )  # fmt: skip
                for k, p in zip(active, pos):
                    self._written[reqs[k]] = p + 1
        out: dict[int, Any] = {}
        for k in drafting:
            item, draft = items[k], drafts[k]
            item.draft = draft
            item.num_tokens += len(draft)
            req = reqs[k]
            if draft and not req.params.is_greedy and not isinstance(req.grammar, VerifiedMatcher):
                out[k] = torch.stack(probs[k])  # [len(draft), V]
        return out

    def _forward(
        self,
        ids: list[int],
        prefix: list[int],
        extend: list[int],
        rows: list[int],
        logits_rows: list[int],
    ) -> torch.Tensor:  # [len(logits_rows), V] float32
        """One ragged draft forward (every item has >= 1 new token: `extend[i] > 0`)."""
        table = self.page_table.table.numpy()[rows]  # [B, P] int32, as the executor's
        fb = ForwardBatch.from_parts(
            ids, prefix, extend, table, logits_rows, self.runner.page_size, self.device
        )
        self.num_forwards += 1
        return self.runner.forward(fb)

    def _sample(
        self,
        reqs: list[Request],
        logits: torch.Tensor,
        drafts: list[list[int]],
        grammar: GrammarStep | None,
    ) -> tuple[list[int], torch.Tensor]:
        """One draft token per row and the distribution `[B, V]` it was drawn from (as the
        target samples: masks, penalties, filters; one-hot for greedy rows)."""
        rows = list(range(logits.shape[0]))
        x, suppress, _, _ = masked_rows(reqs, logits, rows, drafts, self.eos_token_ids, grammar)
        gens = [self._generator(r) for r in reqs]
        info = sampling_info(reqs, suppress, drafts, gens, logits.shape[-1], x.device)
        q = self.sampler.probs(x, info)  # [B, V]
        return pick(q, self.sampler.uniforms(info)).tolist(), q

    def _ends(self, item: ScheduledItem, tok: int) -> bool:
        """`tok` would stop the request (a stop token, or EOS unless ignored)."""
        params = item.req.params
        eos = not params.ignore_eos and tok in self.eos_token_ids
        return eos or tok in params.stop_token_ids

    def _generator(self, req: Request) -> torch.Generator | None:
        """A seeded request's draft generator (its own stream; None: the sampler's default)."""
        seed = req.params.seed
        if seed is None:
            return None
        gen = self._generators.get(req)
        if gen is None:
            gen = make_generator(((seed + req.index) ^ _DRAFT_SEED_SALT) % (1 << 64))
            self._generators[req] = gen
        return gen
