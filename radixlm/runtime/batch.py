"""The boundary objects of one engine step (CPU-side, no tensors).

```
batch  = scheduler.schedule()          # ScheduledBatch: the plan (and the requests it failed)
out    = executor.run(batch)           # StepOutput: tokens, logprobs, failures as values
result = scheduler.update(batch, out)  # StepResult: what each request appended, what finished
processor.emit(result)                 # RequestOutput deltas to the sinks
```

NOTE: invariants
- `ScheduledBatch.items[i].num_tokens` new tokens of `items[i].req` are computed, starting at
  `req.num_computed_tokens` (not advanced until `update`).
- `samples` are the requests that get one sampled token this step, in logits-row order of the
  items that finish their uncomputed tokens; n > 1 branches forked this step sample from their
  parent's row (`SampleSlot.item`), so `len(StepOutput.token_ids) == len(batch.samples)`.
- `page_copies` (src, dst) are copied by the executor after the forward (the source page is a
  partial page written by this very forward).
- `failed` requests are already finished (with an error) and hold no pages; they ride with the
  plan only so that their last delta is emitted by the same path as everything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.runtime.request import Request, TokenLogprob


@dataclass
class ScheduledItem:
    req: Request
    num_tokens: int  # new tokens computed for this request this step (its draft included)
    # Speculative decoding: draft tokens computed after the request's last token, verified
    # by this step's sampling; they are not in `req.token_ids` unless accepted.
    draft: list[int] = field(default_factory=list)
    # Draft model: the most draft tokens it may propose for this item (pages are reserved for
    # them); before the forward it sets `draft` and adds them to `num_tokens`.
    draft_limit: int = 0
    # Positions of `draft` holding text the grammar forces after the token before them
    # (`drafter.Draft`): accepted without a sample once the draft stands up to them.
    forced: frozenset[int] = frozenset()

    @property
    def num_known(self) -> int:
        """Tokens of `req.token_ids` this item computes (the rest are draft)."""
        return self.num_tokens - len(self.draft)

    @property
    def samples(self) -> bool:
        """It computes up to the request's last token: the request samples this step."""
        return self.req.num_computed_tokens + self.num_known == self.req.num_tokens


@dataclass
class SampleSlot:
    """A request that samples this step from the last logits row of `items[item]`."""

    req: Request
    item: int


@dataclass
class ScheduledBatch:
    items: list[ScheduledItem]
    samples: list[SampleSlot] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (src page, dst page)
    # n > 1 branches forked this step: (parent, child, dst page of the partial copy or None).
    forks: list[tuple[Request, Request, int | None]] = field(default_factory=list)
    # Requests `schedule()` finished with an error (compile failure, no room, a fault).
    failed: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    @property
    def requests(self) -> list[Request]:
        """Every request this batch runs: its items' and the branches it forks."""
        return [i.req for i in self.items] + [child for _, child, _ in self.forks]

    def __bool__(self) -> bool:
        return bool(self.items)

    def without(self, culprits: list[Request]) -> tuple[ScheduledBatch, list[Request]]:
        """This batch without `culprits` and the branches they fork (items, sample slots, forks
        and page copies dropped, item indices remapped); and the requests dropped."""
        bad = {id(r) for r in culprits}
        for parent, child, _ in self.forks:
            if id(parent) in bad:
                bad.add(id(child))
        kept = [k for k, item in enumerate(self.items) if id(item.req) not in bad]
        remap = {old: new for new, old in enumerate(kept)}
        out = ScheduledBatch([self.items[k] for k in kept], failed=list(self.failed))
        out.samples = [
            SampleSlot(s.req, remap[s.item])
            for s in self.samples
            if s.item in remap and id(s.req) not in bad
        ]
        out.forks = [f for f in self.forks if id(f[1]) not in bad]
        dsts = {dst for _, _, dst in out.forks if dst is not None}
        out.page_copies = [c for c in self.page_copies if c[1] in dsts]
        dropped = [r for r in self.requests if id(r) in bad]
        return out, dropped


@dataclass(frozen=True)
class SampleError:
    """Why sampling failed for one request (it fails; the others in the step do not):
    `code` becomes its `error_code` ("internal", "grammar_dead_end", ...)."""

    message: str
    code: str = "internal"
    keyword: str | None = None  # a grammar dead end: the schema keyword refusing the last token


@dataclass
class StepOutput:
    """What the executor computed for a `ScheduledBatch`. Failures are values: the step goes
    on through `scheduler.update`, which finishes the failed requests."""

    # One per `ScheduledBatch.samples`: the sampled token and (when asked) its logprob.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Per item index: the logprobs of the prompt tokens `positions.start + 1 ...` (prompt
    # logprob rows of that item), absent when the item had none.
    prompt_logprobs: dict[int, tuple[range, list[float]]] = field(default_factory=dict)
    # Per item index, when its request asks for top logprobs: the top (token, logprob) pairs
    # at the same positions.
    prompt_top_logprobs: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)
    # Per sample index of an item with a draft: the draft tokens accepted (with their logprobs
    # when asked), which precede `token_ids[i]` (the token sampled after them).
    accepted: dict[int, tuple[list[int], list[TokenLogprob | None]]] = field(default_factory=dict)
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    # Per sample index: why sampling failed for that request alone (it is failed, the others
    # in the step are not); its `token_ids` entry is meaningless.
    errors: dict[int, SampleError] = field(default_factory=dict)
    # Requests dropped from the batch because their forward fails (found by running each alone),
    # with the reason: the batch that ran is the scheduled one without them.
    dropped: list[tuple[Request, str]] = field(default_factory=list)
    # The forward failed for the whole batch: every request of the batch fails with this.
    batch_error: str | None = None

    @property
    def ran(self) -> bool:
        """The model ran (a forward happened and its tokens are valid)."""
        return self.batch_error is None


@dataclass
class SeqUpdate:
    """One request's change in one step: the tokens it appended (its `token_ids` grew by them),
    the text they detokenized to, and the logprobs to report for them."""

    req: Request
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """Prompt logprobs computed this step for `req`: entry j is log p(prompt[positions[j] + 1]);
    `top[j]` the top pairs at that position when asked."""

    req: Request
    positions: range
    values: list[float]
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class StepResult:
    """What `scheduler.update` (or an abort) did to requests, for the output processor: one
    update per request that changed, in order; a finished request (`req.is_finished`) has
    released its pages already."""

    updates: list[SeqUpdate] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)

    @classmethod
    def finished(cls, reqs: list[Request]) -> StepResult:
        return cls([SeqUpdate(r) for r in reqs])

    @property
    def finished_requests(self) -> list[Request]:
        return [u.req for u in self.updates if u.req.is_finished]
