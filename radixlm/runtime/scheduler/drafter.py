"""Draft tokens for speculative decoding, from the request's own tokens (prompt lookup).

The longest recent n-gram of the sequence (n from `ngram_max` down to `ngram_min`) that occurred
earlier in the prompt or output is looked up; the tokens that followed its latest earlier
occurrence are the draft. Agent loops, JSON extraction and quoting chat turns repeat spans of
their context, which is what this finds. Nothing is drafted for a sequence without a match.

Each request's n-gram index is built incrementally (only tokens appended since the last
proposal are indexed), so a proposal costs O(new tokens x n-gram sizes), not O(context).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from radixlm.runtime.request import Request


@dataclass
class _Index:
    # n -> {n-gram: end position of its latest occurrence ending before the last token}
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    upto: int = 0  # n-grams ending at positions < upto are indexed


class NgramDrafter:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._index: weakref.WeakKeyDictionary[Request, _Index] = weakref.WeakKeyDictionary()

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow `req.token_ids` (empty: no match)."""
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
