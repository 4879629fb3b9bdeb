"""Draft tokens for speculative decoding, without a draft model. Two sources, in order:

1. The radix tree: when the tree holds the request's whole sequence and more (another request
   computed this prefix and went on: a repeated program, an agent loop replaying a step, a
   fork's sibling), the continuation it holds is the draft (`RadixCache.continuation`).
2. Prompt lookup: the longest recent n-gram of the sequence (n from `ngram_max` down to
   `ngram_min`) that occurred earlier in its prompt or output; the tokens that followed its
   latest earlier occurrence are the draft. Agent loops, JSON extraction and quoting chat turns
   repeat spans of their context, which is what this finds.

Nothing is drafted for a sequence that neither finds.

Each request's n-gram index is built incrementally (only tokens appended since the last
proposal are indexed), so a proposal costs O(new tokens x n-gram sizes), not O(context).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from radixlm.radix import RadixCache
from radixlm.runtime.grammar.base import GrammarMatcher
from radixlm.runtime.request import Request


@dataclass
class _Index:
    # n -> {n-gram: end position of its latest occurrence ending before the last token}
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    upto: int = 0  # n-grams ending at positions < upto are indexed
    accepted_len: float | None = None  # moving average of the accepted draft length


class Drafter:
    def __init__(self, cache: RadixCache | None, ngram_min: int, ngram_max: int) -> None:
        self.cache = cache
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._index: weakref.WeakKeyDictionary[Request, _Index] = weakref.WeakKeyDictionary()

    def draft_length(self, req: Request, most: int) -> int:
        """Adaptive: one more than the request's recent mean accepted length (at most `most`,
        at least 1); `most` until it has verified a draft."""
        idx = self._index.get(req)
        if idx is None or idx.accepted_len is None:
            return most
        return max(1, min(most, round(idx.accepted_len) + 1))

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens of which `accepted` stood."""
        idx = self._index.get(req)
        if idx is None:  # a draft model's first verified draft (no lookup made an index)
            idx = self._index[req] = _Index({n: {} for n in self._sizes()})
        prev = idx.accepted_len
        idx.accepted_len = accepted if prev is None else 0.5 * prev + 0.5 * accepted

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow `req.token_ids` (empty: no match)."""
        if self.cache is not None:
            held = self.cache.continuation(req.token_ids, limit, req.namespace)
            if held:
                return held
        return self._lookup(req, limit)

    def _lookup(self, req: Request, limit: int) -> list[int]:
        tokens = req.token_ids
        last = len(tokens)
        idx = self._index.get(req)
        if idx is None:
            idx = self._index[req] = _Index({n: {} for n in self._sizes()})
        # Index every n-gram ending before the last token (the suffix itself is looked up).
        for end in range(max(idx.upto, 1), last):
            for n in self._sizes():
                if end >= n:
                    idx.ends[n][tuple(tokens[end - n : end])] = end
        idx.upto = last
        for n in self._sizes():
            if last < n:
                continue
            end = idx.ends[n].get(tuple(tokens[last - n :]))
            if end is not None:
                return tokens[end : end + limit]
        return []

    def _sizes(self) -> range:
        return range(self.ngram_max, self.ngram_min - 1, -1)


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
