"""Shared constants and the decoding walk for the grammar tests."""

from __future__ import annotations

from collections.abc import Sequence

from radixlm.runtime.grammar.base import GrammarMatcher
from radixlm.runtime.grammar.bitmask import allocate_bitmask, is_token_allowed
from radixlm.runtime.grammar.verified import VerifiedMatcher
from radixlm.runtime.grammar.vocab import TokenVocab

VOCAB_SIZE = 49152  # SmolLM2-135M-Instruct
EOS = 2
BACKENDS = ("xgrammar", "outlines", "llguidance")
# One token per byte, EOS last: walking a text byte by byte through a matcher built on it is
# exactly "the grammar accepts this string", whatever a real tokenizer would split it into.
BYTE_EOS = 256
BYTE_VOCAB = TokenVocab(
    tuple(bytes([b]) for b in range(256)) + (None,), (BYTE_EOS,), encode=lambda s: list(s.encode())
)


def _verifier_refuses(matcher: GrammarMatcher, token: int) -> bool:
    """The sampling step's check after the mask (schemas beyond context-free): a refused
    token is masked and resampled, so a text that needs it is not generated."""
    return isinstance(matcher, VerifiedMatcher) and matcher.check_token(token) is not None


def grammar_accepts(matcher: GrammarMatcher, text: str) -> bool:
    """Walk ``text`` (on a ``BYTE_VOCAB`` matcher) byte by byte the way decoding does (mask,
    then accept); True if the grammar allows the whole text and then EOS."""
    mask = allocate_bitmask(1, BYTE_VOCAB.vocab_size)
    for b in text.encode():
        matcher.fill_bitmask(mask, 0)
        if not is_token_allowed(mask, 0, b) or _verifier_refuses(matcher, b):
            return False
        assert matcher.accept_token(b), "token allowed by the mask but rejected"
    matcher.fill_bitmask(mask, 0)
    eos = is_token_allowed(mask, 0, BYTE_EOS) and not _verifier_refuses(matcher, BYTE_EOS)
    assert eos == matcher.is_completed()
    return eos


def walk(
    matcher: GrammarMatcher,
    token_ids: Sequence[int],
    *,
    finish: bool = True,
    eos_only_at_end: bool = True,
) -> None:
    """Feed ``token_ids`` through ``matcher`` the way decoding does: at each step the token must
    be allowed by the filled bitmask and then accepted, and EOS is allowed exactly when the
    matcher says the text is complete (never before the end with ``eos_only_at_end``). With
    ``finish``, EOS must then be allowed and terminate the matcher."""
    mask = allocate_bitmask(1, matcher.vocab.vocab_size)
    for step, tok in enumerate(token_ids):
        matcher.fill_bitmask(mask, 0)
        assert is_token_allowed(mask, 0, tok), f"token {tok} masked at step {step}"
        eos_ok = is_token_allowed(mask, 0, EOS)
        assert eos_ok == matcher.is_completed(), f"EOS bit disagrees at step {step}"
        if eos_only_at_end:
            assert not eos_ok, f"EOS allowed too early, at step {step}"
        assert matcher.accept_token(tok), f"token {tok} rejected at step {step}"
    if finish:
        matcher.fill_bitmask(mask, 0)
        assert is_token_allowed(mask, 0, EOS), "EOS masked at the end"
        assert matcher.is_completed() and not matcher.is_terminated()
        assert matcher.accept_token(EOS)
        assert matcher.is_terminated()
