"""Loose masks for short string bounds: llguidance computes the mask of a JSON string whose
``maxLength`` is within a token's reach by walking the whole token trie (100-800 us a row);
without the bound it costs ~10-40 us. ``without_short_max_lengths`` gives the schema a twin
matcher is built on; ``LooseMasks`` narrows the twin's mask back by the string's remaining
length (``LLGuidanceMatcher.fill_bitmask_loose``), and the exact matcher checks what it still
adds (``check_token``, in ``GrammarStep.verify``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixlm.runtime.grammar.bitmask import bitmask_width
from radixlm.runtime.grammar.schema_keywords import NON_ASSERTING
from radixlm.runtime.grammar.vocab import TokenVocab

# A plain string's ``maxLength`` up to this is left out of the grammar that fills the masks
# (``LooseMasks``). Measured (llguidance 1.9, SmolLM2's 49k vocabulary, one mask of an array
# of such strings, median over its positions): maxLength 10 540 us, 24 245, 28 312, 32 105,
# 36 28, 40-256 31-46 us; none ~10 us. Below ~34 characters the bound is within a token's
# reach and the mask walks the whole token trie at every position.
_MAX_LOOSE_MAX_LENGTH = 32
_PLAIN_STRING_KEYS = frozenset({"type", "minLength", "maxLength"})
# Subschemas that apply beside ``properties`` / ``items`` (a value may then match another
# string schema, in a union: its remaining length is not the bound's alone).
_SIDE_SUBSCHEMAS = frozenset({"anyOf", "oneOf", "allOf", "not", "if", "then", "else", "$ref",
                              "$dynamicRef", "patternProperties", "dependentSchemas",
                              "unevaluatedProperties", "unevaluatedItems", "contains",
                              "propertyNames", "dependencies"})  # fmt: skip


def without_short_max_lengths(schema: Any, depth: int = 0) -> Any:
    """``schema`` without the ``maxLength`` (at most ``_MAX_LOOSE_MAX_LENGTH``) of each plain
    string schema (``type`` string, ``minLength``, ``maxLength`` and annotations only,
    ``minLength`` no larger) that is the only schema of its values: the root, or reached from
    it through ``properties``, ``additionalProperties``, ``items`` and ``prefixItems`` of
    objects and arrays with no other subschema beside (no ``anyOf``, ``allOf``, ``not``,
    ``$ref``, ``patternProperties``, ...). A relaxation (it admits every instance ``schema``
    does); ``LooseMasks`` narrows it back by the string's remaining length, which is the bound
    alone only where no other schema applies to the string."""
    if not isinstance(schema, dict) or depth > 128:
        return schema
    bound, kinds, least = schema.get("maxLength"), schema.get("type"), schema.get("minLength", 0)
    if (
        type(bound) is int
        and 0 <= bound <= _MAX_LOOSE_MAX_LENGTH
        and (kinds == "string" or isinstance(kinds, list) and "string" in kinds)
        and type(least) is int
        and least <= bound
        and all(k in _PLAIN_STRING_KEYS or k in NON_ASSERTING for k in schema)
    ):
        return {k: v for k, v in schema.items() if k != "maxLength"}
    if any(k in _SIDE_SUBSCHEMAS for k in schema):
        return schema
    out = dict(schema)
    for key in ("additionalProperties", "items"):
        if isinstance(schema.get(key), dict):
            out[key] = without_short_max_lengths(schema[key], depth + 1)
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {
            name: without_short_max_lengths(sub, depth + 1)
            for name, sub in schema["properties"].items()
        }
    if isinstance(schema.get("prefixItems"), list):
        out["prefixItems"] = [
            without_short_max_lengths(sub, depth + 1) for sub in schema["prefixItems"]
        ]
    return out


class LooseMasks:
    """Per vocabulary: which tokens fit a plain string's remaining length. A matcher whose
    grammar has short string bounds fills its masks from a twin without them
    (``without_short_max_lengths``), which costs ~10-40 us a mask instead of 100-800, and
    inside such a string keeps only the tokens that fit (``rows[k]``: the tokens of at most
    ``k`` characters without a quote or backslash, and every token with one). The remaining
    length ``k`` is read from the exact matcher: how many of ``probe`` (a plain one-character
    token, repeated past any loose bound) it would take, against the twin. The mask is then a
    superset of the exact one only by tokens with a quote or backslash (or at positions where
    a token may open a string); ``check_token`` on the exact matcher decides each sampled
    token (``GrammarStep.verify``)."""

    def __init__(self, vocab: TokenVocab) -> None:
        # NOTE: NumPy, not torch: a torch op on the grammar threads would give each its own
        # OpenMP team, and with more teams' threads than CPUs libgomp cuts its spinning: the
        # forward's parallel regions then start with a futex wake (measured: 2x slower steps).
        width = bitmask_width(vocab.vocab_size)
        ids = {data: t for t, data in enumerate(vocab.token_bytes) if data and len(data) == 1}
        self.probe = [ids[b"a"]] * (_MAX_LOOSE_MAX_LENGTH + 1) if b"a" in ids else []
        # Taken only inside a string right after a backslash / within a UTF-8 character.
        self.after_escape = [ids[b"u"]] if b"u" in ids else []
        self.within_char = [ids[b"\x80"]] if b"\x80" in ids else []
        chars = np.full(width * 32, 1 << 30, dtype=np.int64)  # [32 W]
        for t, data in enumerate(vocab.token_bytes):
            if data is not None and (b'"' in data or b"\\" in data):
                chars[t] = -1  # decided by the exact check
            elif data is not None:
                chars[t] = sum(1 for b in data if b & 0xC0 != 0x80)  # characters it starts
        ks = np.arange(_MAX_LOOSE_MAX_LENGTH + 1)[:, None]  # [bound + 1, 1]
        fits = (chars[None, :] <= ks).reshape(len(ks), width, 32)  # [bound + 1, W, 32]
        words = np.packbits(fits, axis=2, bitorder="little").view("<u4")  # [bound + 1, W, 1]
        self.rows = np.ascontiguousarray(words[..., 0]).view(np.int32)  # [bound + 1, W]
        self.quoted = chars < 0  # [32 W] a token with a quote or a backslash

    def narrow(self, bitmask: torch.Tensor, row: int, left: int) -> None:
        """``bitmask[row]`` keeps only the tokens that fit ``left`` more characters (NumPy:
        this runs on the mask worker)."""
        words = bitmask.numpy()[row]  # [W], shares the memory
        np.bitwise_and(words, self.rows[left], out=words)

    def available(self) -> bool:
        return bool(self.probe and self.after_escape and self.within_char)
