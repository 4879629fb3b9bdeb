"""The byte view of a tokenizer that every grammar backend shares.

A grammar constrains *bytes*; a model samples *token ids*. ``TokenVocab`` maps each id of the
model's vocabulary to the exact bytes it contributes to the output, or to ``None`` for ids that a
grammar must never allow: special tokens (EOS included: it is handled separately), added special
tokens, and the padding rows of an embedding larger than the tokenizer.

Invariants:

- ``len(token_bytes) == vocab_size`` (the model's logits width, >= the tokenizer's size);
- ``token_bytes[t] is None`` for every EOS id and every special token; otherwise it is non-empty;
- ``join(ids)`` of the ids that ``encode(text)`` returns is ``text.encode()`` for byte-level
  tokenizers (checked, never assumed, by jump-forward).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

TokenEncoding = Literal["byte_level", "byte_fallback", "metaspace", "raw"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"  # SentencePiece's visible space


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable stand-in char -> raw byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()


def detect_encoding(tokenizer: Any) -> TokenEncoding:
    """How the tokenizer's vocabulary strings encode bytes, from its decoder pipeline."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "raw"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = [decoder, *decoder.get("decoders", [])]
    types = {d.get("type") for d in parts if isinstance(d, dict)}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types:
        return "byte_fallback"
    replaces = any(
        d.get("type") == "Replace" and _SPIECE_SPACE in json.dumps(d.get("pattern"))
        for d in parts
        if isinstance(d, dict)
    )
    return "metaspace" if "Metaspace" in types or replaces else "raw"


def decode_token(text: str, encoding: TokenEncoding) -> bytes:
    """Raw bytes of one (non-added) vocabulary string."""
    if encoding == "byte_level":
        try:
            return bytes(_BYTE_DECODER[c] for c in text)
        except KeyError:
            return text.encode()
    if encoding == "byte_fallback":
        m = _BYTE_FALLBACK.fullmatch(text)
        if m:
            return bytes([int(m.group(1), 16)])
    if encoding in ("byte_fallback", "metaspace"):
        return text.replace(_SPIECE_SPACE, " ").encode()
    return text.encode()


@dataclass(eq=False)
class TokenVocab:
    """Token id -> output bytes for one model, plus the tokenizer's encoder (for jump-forward).

    ``single_byte_ids[b]`` is a token whose bytes are exactly ``bytes([b])`` (None if the
    vocabulary has none).
    """

    token_bytes: tuple[bytes | None, ...]  # [vocab_size]
    eos_token_ids: tuple[int, ...]
    encode: Callable[[str], list[int]] = field(repr=False)
    single_byte_ids: tuple[int | None, ...] = field(init=False, repr=False)  # [256]

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("TokenVocab needs at least one EOS token id")
        for t in self.eos_token_ids:
            if not 0 <= t < len(self.token_bytes):
                raise ValueError(f"EOS id {t} outside the vocabulary [0, {len(self.token_bytes)})")
        if any(self.token_bytes[t] is not None for t in self.eos_token_ids):
            raise ValueError("EOS ids must map to None in token_bytes")
        single: list[int | None] = [None] * 256
        for i, b in enumerate(self.token_bytes):
            if b is not None and len(b) == 1 and single[b[0]] is None:
                single[b[0]] = i
        self.single_byte_ids = tuple(single)

    @property
    def has_all_single_bytes(self) -> bool:
        return all(t is not None for t in self.single_byte_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def join(self, token_ids: Sequence[int]) -> bytes | None:
        """The bytes the tokens spell, or None if one of them is special / out of range."""
        out = bytearray()
        for t in token_ids:
            b = self.token_bytes[t] if 0 <= t < len(self.token_bytes) else None
            if b is None:
                return None
            out += b
        return bytes(out)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> TokenVocab:
        """Build from a Hugging Face tokenizer. ``vocab_size`` is the model's logits width; ids
        at or above it are dropped, ids the tokenizer lacks stay None (padding)."""
        eos = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        encoding = detect_encoding(tokenizer)
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special.update(eos)
        out: list[bytes | None] = [None] * vocab_size
        for text, i in tokenizer.get_vocab().items():
            if not 0 <= i < vocab_size or i in special:
                continue
            tok = added.get(i)
            if tok is not None:
                if getattr(tok, "special", False):
                    continue
                data = str(getattr(tok, "content", text)).encode()
            else:
                data = decode_token(text, encoding)
            out[i] = data or None

        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust core
        if backend is not None:
            # The Rust tokenizer itself: what a fast tokenizer's ``encode`` calls, without its
            # Python layers (~6 us against ~17 us a call; jump-forward re-spells text per step).

            def encode(text: str) -> list[int]:
                return list(backend.encode(text, add_special_tokens=False).ids)

        else:

            def encode(text: str) -> list[int]:
                return list(tokenizer.encode(text, add_special_tokens=False))

        return cls(token_bytes=tuple(out), eos_token_ids=eos, encode=encode)
