"""Jump-forward decoding: append the text the grammar forces without sampling it.

When every continuation of the grammar starts with the same bytes (``{"name":"`` at the start of
a one-property object), those bytes are appended as tokens in one go. Token boundaries: the
forced bytes are re-tokenized *together with* the last ``max_rollback`` tokens of the sequence,
so a token the model sampled that the forced text would merge with (``{`` followed by forced
``"name"`` becomes ``{"`` ``name``) is rolled back and replaced. The result spells exactly the
same bytes, each of its tokens is accepted by the matcher (masks are byte-exact), so it is a
sequence token-by-token constrained decoding could have produced.

Invariants of ``jump_forward``:

- on return the matcher has accepted ``recent[:len(recent) - num_rollback] + token_ids``;
- ``join(recent[-num_rollback:]) + forced == join(token_ids) + rest``, where ``rest`` is the
  part of the forced bytes not emitted (cut by ``max_tokens`` or an incomplete UTF-8 tail);
- ``len(token_ids) - num_rollback <= max_tokens`` when ``max_tokens`` is given;
- any failed check leaves the matcher untouched and returns a no-op.

Limits: xgrammar cannot report forced text that starts inside a UTF-8 character (after a
byte-fallback token), and a tokenizer that does not round-trip text fragments (SentencePiece
adding a prefix space) gets no jump; both are no-ops, never wrong tokens.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from radixlm.runtime.grammar.base import GrammarMatcher
from radixlm.runtime.grammar.vocab import TokenVocab


@dataclass(frozen=True)
class JumpForward:
    """What to do to the sequence: drop its last ``num_rollback`` tokens, then append
    ``token_ids`` (both already applied to the matcher). ``must_stop``: the grammar is now
    complete and allows nothing but EOS, so the sequence can finish without sampling it."""

    num_rollback: int = 0
    token_ids: tuple[int, ...] = ()
    must_stop: bool = False

    @property
    def is_noop(self) -> bool:
        return not self.token_ids and not self.num_rollback


def _valid_utf8_prefix(data: bytes) -> bytes:
    """``data`` minus an incomplete UTF-8 character at its end (b"" if invalid elsewhere)."""
    for cut in range(min(4, len(data)) + 1):
        head = data[: len(data) - cut]
        try:
            head.decode("utf-8")
        except UnicodeDecodeError:
            continue
        return head
    return b""


# Per vocabulary, ``retokenize``'s answers: a schema's forced keys and punctuation come back
# with the same few sampled tokens before them, and a tokenizer call costs ~50-90 us of Python.
_Respelled = dict[tuple[tuple[int, ...], bytes], tuple[int, tuple[int, ...]] | None]
_RESPELLED: weakref.WeakKeyDictionary[TokenVocab, _Respelled] = weakref.WeakKeyDictionary()
_MAX_RESPELLED = 4096  # entries per vocabulary (cleared when full)


def retokenize(
    vocab: TokenVocab, tail: Sequence[int], forced: bytes
) -> tuple[int, list[int]] | None:
    """(rollback, new tokens) re-spelling ``join(tail) + forced`` (or its longest valid UTF-8
    prefix), or None when the tokenizer does not round-trip those bytes. Remembered per
    vocabulary (the answer depends only on the tokenizer and the inputs)."""
    memo = _RESPELLED.get(vocab)
    if memo is None:
        memo = _RESPELLED.setdefault(vocab, {})
    key = (tuple(tail), forced)
    if key in memo:
        hit = memo[key]
        return None if hit is None else (hit[0], list(hit[1]))
    out = _respell(vocab, tail, forced)
    if len(memo) >= _MAX_RESPELLED:
        memo.clear()
    memo[key] = None if out is None else (out[0], tuple(out[1]))
    return out


def _respell(vocab: TokenVocab, tail: Sequence[int], forced: bytes) -> tuple[int, list[int]] | None:
    tail_bytes = vocab.join(tail)
    if tail_bytes is None:
        return None
    data = _valid_utf8_prefix(tail_bytes + forced)
    if len(data) <= len(tail_bytes):
        return None
    ids = vocab.encode(data.decode("utf-8"))
    if vocab.join(ids) != data:
        return None
    keep = 0
    while keep < min(len(ids), len(tail)) and ids[keep] == tail[keep]:
        keep += 1
    return len(tail) - keep, ids[keep:]


def jump_forward(
    matcher: GrammarMatcher,
    vocab: TokenVocab,
    recent_tokens: Sequence[int] = (),
    *,
    max_tokens: int | None = None,
    max_rollback: int = 1,
) -> JumpForward:
    """Extend ``matcher`` by the text its grammar forces; see the module docstring.

    ``recent_tokens``: the sequence's last tokens, already accepted by the matcher, that may be
    rolled back (pass only tokens whose KV is not computed yet, e.g. the token sampled this
    step; ``()`` at the very start). ``max_tokens``: how much the sequence may still grow.
    """
    if matcher.is_terminated():
        return JumpForward(must_stop=True)
    forced = matcher.forced_bytes()
    if not forced or (max_tokens is not None and max_tokens <= 0):
        return JumpForward(must_stop=matcher.only_eos_allowed())
    recent = list(recent_tokens)
    k_max = min(max_rollback, len(recent), matcher.num_accepted)
    plan = None
    for k in range(k_max, -1, -1):
        tail = recent[len(recent) - k :]
        plan = retokenize(vocab, tail, forced)
        if plan is not None:
            break
    if plan is None:
        return JumpForward()
    rollback, new = plan
    if max_tokens is not None:
        new = new[: max_tokens + rollback]
    removed = recent[len(recent) - rollback :] if rollback else []
    if not new or new == removed:
        return JumpForward()
    matcher.rollback(rollback)
    if not matcher.accept_tokens(new):
        ok = matcher.accept_tokens(removed)  # restore the state we started from
        assert ok, "re-accepting rolled-back tokens failed"
        return JumpForward()
    return JumpForward(rollback, tuple(new), must_stop=matcher.only_eos_allowed())
