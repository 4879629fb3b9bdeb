"""The boundary objects of one engine step (CPU-side, no tensors).

```
batch = scheduler.schedule()          # ScheduledBatch
out   = executor.run(batch)           # StepOutput
done  = scheduler.update(batch, out)  # finished requests
processor.drain()                     # emit
```

NOTE: invariants
- `ScheduledBatch.items[i].num_tokens` new tokens of `items[i].req` are computed, starting at
  `req.num_computed_tokens` (not advanced until `update`).
- `samples` are the requests that get one sampled token this step, in logits-row order of the
  items that finish their uncomputed tokens; n > 1 branches forked this step sample from their
  parent's row (`SampleSlot.item`), so `len(StepOutput.samples) == len(batch.samples)`.
- `page_copies` (src, dst) are copied by the executor after the forward (the source page is a
  partial page written by this very forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.runtime.request import Request, TokenLogprob


@dataclass
class ScheduledItem:
    req: Request
    num_tokens: int  # new tokens computed for this request this step


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

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass
class StepOutput:
    """What the executor computed for a `ScheduledBatch`."""

    # One per `ScheduledBatch.samples`: the sampled token and (when asked) its logprob.
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # Per item index: the logprobs of the prompt tokens `positions.start + 1 ...` (prompt
    # logprob rows of that item), absent when the item had none.
    prompt_logprobs: dict[int, tuple[range, list[float]]] = field(default_factory=dict)
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
