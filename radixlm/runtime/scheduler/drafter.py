"""Draft tokens for speculative decoding, without a draft model. Two sources, in order:

1. The radix tree: when the tree holds the request's whole sequence and more (another request
   computed this prefix and went on: a repeated program, an agent loop replaying a step, a
   fork's sibling), the continuation it holds is the draft (`RadixCache.continuation`).
2. Prompt lookup: the longest recent n-gram of the sequence (n from `ngram_max` down to
   `ngram_min`) that occurred earlier in its prompt or output; the tokens that followed its
   latest earlier occurrence are the draft (an n-gram whose occurrences went on differently is
   a source of its own: its acceptance is learned apart). Agent loops, JSON extraction and
   quoting chat turns repeat spans of their context, which is what this finds. With
   `first_token_keys` an n-gram's first token matches regardless of a leading space (`"New"`
   after `":"` matches `" New"` in the prose it is copied from: JSON values and quotes start
   a span without the space).

Nothing is drafted for a sequence that neither finds.

How much of a proposal is verified is the expected-gain model's call (`runtime/spec/gain.py`):
the drafter keeps the acceptance counts per request and draft source (the tree, or the length
of the matched n-gram) and globally per source (the prior of a request's counts), and the
measured step cost (`Drafter.cost`, recorded by the scheduler).

Each request's n-gram index is built incrementally (only tokens appended since the last
proposal are indexed), so a proposal costs O(new tokens x n-gram sizes), not O(context).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from radixlm.radix import RadixCache
from radixlm.runtime.grammar.base import GrammarMatcher
from radixlm.runtime.request import Request
from radixlm.runtime.spec.gain import AcceptanceCounts, StepCost, plan_draft_lengths

TREE = "tree"  # the source of a radix-tree continuation
MODEL = "model"  # the source of a draft model's proposal
# NOTE: per-request counts forget faster than the global ones, which are their prior.
REQUEST_DECAY, GLOBAL_DECAY, PRIOR_WEIGHT = 0.8, 0.98, 2.0


def ngram_source(n: int, ambiguous: bool = False) -> str:
    """The source of a matched n-gram's continuation; `ambiguous`: its earlier occurrences
    went on differently (a JSON key's `":"` before each value), learned apart."""
    return f"ngram{n}~" if ambiguous else f"ngram{n}"


@dataclass(frozen=True)
class Proposal:
    """Draft tokens to follow a request's sequence and where they came from (`TREE`, or
    `ngram_source(n, ambiguous)`: the continuation of a matched n-gram)."""

    tokens: list[int]
    source: str


@dataclass
class _Index:
    # n -> {n-gram key: end position of its latest occurrence ending before the last token}
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    # n -> the n-gram keys whose occurrences were followed by different tokens
    ambiguous: dict[int, set[tuple[int, ...]]] = field(default_factory=dict)
    upto: int = 0  # n-grams ending at positions < upto are indexed
    accepted_len: float | None = None  # moving average of the accepted draft length
    source: str = MODEL  # the source of the latest proposal (what `record` counts)
    counts: dict[str, AcceptanceCounts] = field(default_factory=dict)  # by source


class Drafter:
    def __init__(
        self,
        cache: RadixCache | None,
        ngram_min: int,
        ngram_max: int,
        first_token_keys: Mapping[int, int] | None = None,
    ) -> None:
        self.cache = cache
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.first_token_keys = first_token_keys or {}
        self.cost = StepCost()
        self.counts: dict[str, AcceptanceCounts] = {}  # global, by source
        self._index: weakref.WeakKeyDictionary[Request, _Index] = weakref.WeakKeyDictionary()

    def draft_length(self, req: Request, most: int) -> int:
        """Adaptive (a draft model's length): one more than the request's recent mean accepted
        length (at most `most`, at least 1); `most` until it has verified a draft."""
        idx = self._index.get(req)
        if idx is None or idx.accepted_len is None:
            return most
        return max(1, min(most, round(idx.accepted_len) + 1))

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens of which `accepted` stood (of the source the
        request's latest proposal came from; a draft model's when it proposed none)."""
        idx = self._index.get(req)
        if idx is None:  # a draft model's first verified draft (no lookup made an index)
            idx = self._index[req] = self._new_index()
        prev = idx.accepted_len
        idx.accepted_len = accepted if prev is None else 0.5 * prev + 0.5 * accepted
        idx.counts.setdefault(idx.source, AcceptanceCounts()).add(drafted, accepted, REQUEST_DECAY)
        self.counts.setdefault(idx.source, AcceptanceCounts()).add(drafted, accepted, GLOBAL_DECAY)

    def alpha(self, req: Request, source: str) -> float:
        """The per-token acceptance estimate of a draft from `source` for `req`: its own
        counts shrunk to the source's global estimate (itself shrunk to 1/2)."""
        prior = self.counts.get(source, AcceptanceCounts()).alpha(0.5, PRIOR_WEIGHT)
        idx = self._index.get(req)
        own = idx.counts.get(source) if idx is not None else None
        return prior if own is None else own.alpha(prior, PRIOR_WEIGHT)

    def plan(
        self, proposals: Sequence[tuple[Request, Proposal]], base_rows: int, base_tokens: int
    ) -> list[int]:
        """How many tokens of each proposal to verify this step: the expected-gain model
        (`plan_draft_lengths`) on the measured step cost, given the step's `base_rows` forward
        rows and `base_tokens` sampled tokens without drafts."""
        alphas = [self.alpha(r, p.source) for r, p in proposals]
        lengths = [len(p.tokens) for _, p in proposals]
        return plan_draft_lengths(alphas, lengths, base_rows, base_tokens, self.cost)

    def propose(self, req: Request, limit: int) -> Proposal | None:
        """Up to `limit` draft tokens to follow `req.token_ids` (None: no match)."""
        if self.cache is not None:
            held = self.cache.continuation(req.token_ids, limit, req.namespace)
            if held:
                return self._proposed(req, Proposal(held, TREE))
        return self._lookup(req, limit)

    def _proposed(self, req: Request, p: Proposal) -> Proposal:
        idx = self._index.get(req)
        if idx is None:
            idx = self._index[req] = self._new_index()
        idx.source = p.source
        return p

    def _new_index(self) -> _Index:
        return _Index({n: {} for n in self._sizes()}, {n: set() for n in self._sizes()})

    def _key(self, gram: Sequence[int]) -> tuple[int, ...]:
        """An n-gram's index key: its first token without a leading space (when
        `first_token_keys` maps it), the rest as they are."""
        return (self.first_token_keys.get(gram[0], gram[0]), *gram[1:])

    def _lookup(self, req: Request, limit: int) -> Proposal | None:
        tokens = req.token_ids
        last = len(tokens)
        idx = self._index.get(req)
        if idx is None:
            idx = self._index[req] = self._new_index()
        # Index every n-gram ending before the last token (the suffix itself is looked up).
        for end in range(max(idx.upto, 1), last):
            for n in self._sizes():
                if end >= n:
                    key = self._key(tokens[end - n : end])
                    prev = idx.ends[n].get(key)
                    if prev is not None and tokens[prev] != tokens[end]:
                        idx.ambiguous[n].add(key)
                    idx.ends[n][key] = end
        idx.upto = last
        for n in self._sizes():
            if last < n:
                continue
            key = self._key(tokens[last - n :])
            end = idx.ends[n].get(key)
            if end is not None:
                source = ngram_source(n, key in idx.ambiguous[n])
                return self._proposed(req, Proposal(tokens[end : end + limit], source))
        return None

    def _sizes(self) -> range:
        return range(self.ngram_max, self.ngram_min - 1, -1)


def first_token_keys(token_bytes: Sequence[bytes | None]) -> dict[int, int]:
    """Token id -> the id of the same token without its leading space, for every token that
    starts with a space and whose remainder is a token too (`" New"` -> `"New"`)."""
    ids = {b: i for i, b in enumerate(token_bytes) if b}
    return {
        i: ids[b[1:]]
        for i, b in enumerate(token_bytes)
        if b and len(b) > 1 and b[:1] == b" " and b[1:] in ids
    }


def draft_token_ok(fork: GrammarMatcher, token: int, jump_forward: bool) -> bool:
    """Advance `fork` (a fork of a request's matcher, through the draft so far) by a draft
    token: True when the grammar takes it, does not end after it, and (with jump-forward) forces
    nothing after it. NOTE: where the grammar forces text, plain decoding appends the forced
    tokens (possibly re-tokenizing the sampled one) instead of sampling the next; a draft token
    there would bypass that, so the token must be the step's sampled one, which goes through the
    appender's jump-forward. Cutting there keeps drafting token-identical to plain decoding."""
    if not fork.accept_token(token) or fork.is_terminated():
        return False
    return not (jump_forward and fork.forced_bytes())


def grammar_prefix(matcher: GrammarMatcher, draft: list[int], jump_forward: bool) -> list[int]:
    """The longest prefix of `draft` whose tokens pass `draft_token_ok` after the request's
    output (walked on a fork: the request's matcher is not touched)."""
    m = matcher.fork()
    for i, t in enumerate(draft):
        if not draft_token_ok(m, t, jump_forward):
            return draft[:i]
    return draft
