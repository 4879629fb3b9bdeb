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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from radixlm.radix import RadixCache
from radixlm.runtime.grammar.base import GrammarMatcher
from radixlm.runtime.grammar.jump_forward import JumpForward, retokenize
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.runtime.request import Request
from radixlm.runtime.spec.gain import (
    AcceptanceCounts,
    Calibration,
    StepCost,
    expected_accepted,
    plan_draft_lengths,
)

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
    planned_alpha: float | None = None  # the estimate its planned draft was sized with
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
        self.calibration = Calibration()  # the planned drafts' realized / expected tokens
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
        if idx.planned_alpha is not None:  # sized by `plan`: how the model's estimate fared
            expected = expected_accepted(idx.planned_alpha, drafted)
            self.calibration.add(expected, accepted, GLOBAL_DECAY)
            idx.planned_alpha = None

    def alpha(self, req: Request, source: str) -> float:
        """The per-token acceptance estimate of a draft from `source` for `req`: its own
        counts shrunk to the source's global estimate (itself shrunk to 1/2)."""
        prior = self.counts.get(source, AcceptanceCounts()).alpha(0.5, PRIOR_WEIGHT)
        idx = self._index.get(req)
        own = idx.counts.get(source) if idx is not None else None
        return prior if own is None else own.alpha(prior, PRIOR_WEIGHT)

    def plan(
        self, drafts: Sequence[tuple[Request, str, int]], base_rows: int, base_tokens: int
    ) -> list[int]:
        """How many tokens of each draft (request, source, length) to verify this step: the
        expected-gain model (`plan_draft_lengths`) on the measured step cost, given the step's
        `base_rows` forward rows and `base_tokens` sampled tokens without drafts; the expected
        gains scaled by the calibration of the drafts verified so far."""
        alphas = [self.alpha(r, source) for r, source, _ in drafts]
        lengths = [n for _, _, n in drafts]
        scale = self.calibration.scale()
        out = plan_draft_lengths(alphas, lengths, base_rows, base_tokens, self.cost, scale=scale)
        for (req, _, _), a, k in zip(drafts, alphas, out):
            idx = self._index.get(req)
            if idx is not None:
                idx.planned_alpha = a if k else None
        return out

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
    appender's jump-forward. Cutting there keeps drafting token-identical to plain decoding.
    (A draft model's drafts stop there; `grammar_draft` drafts the forced tokens as well.)"""
    if not fork.accept_token(token) or fork.is_terminated():
        return False
    return not (jump_forward and fork.forced_bytes())


@dataclass(frozen=True)
class Draft:
    """Tokens to verify after a request's sequence. `forced`: the positions whose token is text
    the grammar forces after the token before it, exactly as plain decoding's jump-forward
    appends it after sampling that token: once the draft is accepted up to such a run, the run
    stands without being compared with a sample (plain decoding never samples there). A run is
    never separated from the token before it (`cut`)."""

    tokens: list[int]
    forced: frozenset[int] = frozenset()

    @property
    def num_decided(self) -> int:
        """Tokens verified against a sample (the others are forced)."""
        return len(self.tokens) - len(self.forced)

    def cut(self, n: int) -> Draft:
        """The longest prefix of at most `n` tokens that does not end inside a forced run or
        before the run of its last token."""
        n = max(0, min(n, len(self.tokens)))
        while n < len(self.tokens) and n in self.forced:
            n -= 1
        if n == len(self.tokens):
            return self
        return Draft(self.tokens[:n], frozenset(i for i in self.forced if i < n))

    def decided(self, k: int) -> Draft:
        """The first `k` decided tokens with the forced runs that follow them."""
        n, seen = 0, 0
        while n < len(self.tokens) and (n in self.forced or seen < k):
            seen += n not in self.forced
            n += 1
        return self.cut(n)


# Where a value's text ends: the bytes that close one (a string's quote, a member or item
# separator, an object or array end), tried in this order where the draft closes a value.
_CLOSERS = (b'"', b",", b"}", b"]")
_SENTENCE_PUNCT = frozenset(b".,;:!?")

# `jump(matcher, recent_tokens, max_tokens)`: `GrammarManager.jump_forward`.
JumpFn = Callable[..., JumpForward]


def _sentence_end(vocab: TokenVocab, source: Sequence[int], i: int) -> bool:
    """`source[i]` is sentence punctuation ending a phrase: punctuation only (maybe with
    trailing whitespace), followed by whitespace, a special token or nothing more of the
    source's text (`"City."` then `" She"`; not the dot of `"grace.hopper"`)."""
    data = vocab.token_bytes[source[i]]
    if not data or data[0] not in _SENTENCE_PUNCT:
        return False
    body = data.rstrip()
    if any(b not in _SENTENCE_PUNCT for b in body):
        return False
    if len(body) < len(data):
        return True
    if i + 1 >= len(source):
        return False  # the source goes on beyond what was proposed: unknown
    after = vocab.token_bytes[source[i + 1]]
    return after is None or after[:1].isspace()


def _forced_run(
    fork: GrammarMatcher, token: int, jump: JumpFn, max_tokens: int
) -> tuple[int, ...] | None:
    """`fork` has just accepted the draft token `token`: the tokens plain decoding appends
    after sampling it (`()`: none, the grammar forces nothing there), with `fork` advanced
    through them; None when the draft must stop before `token` (the grammar ends after it,
    jump-forward would re-spell it, or the forced text is cut by `max_tokens`)."""
    if fork.is_terminated():
        return None
    if not fork.forced_bytes():
        return ()
    jf = jump(fork, [token], max_tokens=max_tokens)
    if jf.num_rollback or not jf.token_ids or len(jf.token_ids) >= max_tokens:
        return None
    return jf.token_ids


def _closing(fork: GrammarMatcher, vocab: TokenVocab, jump: JumpFn, room: int) -> list[int] | None:
    """Close the open value here: the first of `_CLOSERS` the grammar takes and after which it
    forces text, spelled as the tokenizer spells the closer and that text together (the token
    the model writes there, e.g. `","` before a forced key), then jump-forward's tokens after
    it (walked on forks of `fork`). None when no closer forces anything or the run does not fit
    in `room` tokens."""
    for closer in _CLOSERS:
        cid = vocab.single_byte_ids[closer[0]]
        if cid is None:
            continue
        probe = fork.fork()
        if not probe.accept_token(cid) or probe.is_terminated():
            continue
        forced = probe.forced_bytes()
        spelled = retokenize(vocab, [cid], forced) if forced else None
        if spelled is None or not spelled[1]:
            continue
        token = spelled[1][0] if spelled[0] else cid
        m = fork.fork()
        if not m.accept_token(token):
            continue
        run = _forced_run(m, token, jump, room)
        if run:
            return [token, *run]
    return None


def grammar_draft(
    matcher: GrammarMatcher,
    source: Sequence[int],
    most: int,
    room: int,
    jump: JumpFn | None = None,
    vocab: TokenVocab | None = None,
) -> Draft:
    """A draft from `source` (a proposal, one token longer than `most` to see where a phrase
    ends) that the grammar takes after the request's output, walked on a fork (the request's
    matcher is not touched): at most `most` decided tokens and `room` tokens in all.

    Without jump-forward (`jump` None) it is the longest prefix whose tokens pass
    `draft_token_ok`. With it, a token after which the grammar forces text is drafted with the
    tokens plain decoding appends there (forced positions), and the source goes on after them
    when it spells them too (a JSON record copied whole). Where the source leaves the open value
    (the grammar refuses its next token: a number followed by a word; or the next token ends a
    phrase of prose, `_sentence_end`) the value is closed (`_closing`): the closer and the forced
    text after it (`","` and the next key) are drafted, so that the step that verifies the value
    also computes the key and samples the first token of the next value. A wrong guess costs
    the tokens after it: the sample there is the next token, as without a draft."""
    m = matcher.fork()
    out: list[int] = []
    forced: set[int] = set()
    decided, i = 0, 0

    def close() -> bool:
        """Draft the closing of the open value after `out`; False when it cannot."""
        if jump is None or vocab is None:
            return False
        closed = _closing(m, vocab, jump, room - len(out))
        if closed is None:
            return False
        forced.update(range(len(out) + 1, len(out) + len(closed)))
        out.extend(closed)
        return True

    while i < len(source) and decided < most and len(out) < room:
        t = source[i]
        if vocab is not None and _sentence_end(vocab, source, i) and close():
            break
        if not m.accept_token(t):
            close()
            break
        if jump is None:
            run: tuple[int, ...] | None = None if m.is_terminated() else ()
        else:
            run = _forced_run(m, t, jump, room - len(out))
        if run is None:
            break
        out.append(t)
        decided += 1
        i += 1
        if run:
            forced.update(range(len(out), len(out) + len(run)))
            out.extend(run)
            if list(source[i : i + len(run)]) != list(run):
                break
            i += len(run)
    return Draft(out, frozenset(forced)).cut(room)
