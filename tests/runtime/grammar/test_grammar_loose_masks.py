"""Loose masks for short string bounds (``loose_masks.LooseMasks``): the mask of a twin
grammar without them, narrowed by the fit table, is a superset of the exact mask, and
``check_token`` refuses exactly what it adds; so sampling with it and checking decides as the
exact grammar does."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from grammar_helpers import BYTE_VOCAB

from radixlm.runtime.grammar.base import get_backend
from radixlm.runtime.grammar.bitmask import allocate_bitmask, is_token_allowed
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.loose_masks import LooseMasks, without_short_max_lengths
from radixlm.runtime.grammar.verified import VerifiedMatcher
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.tool_calls import format_tool_call

SHORT = {"type": "string", "maxLength": 5}


def test_only_plain_short_bounds_that_alone_apply_are_left_out() -> None:
    """A bound is left out where its string schema is the only one of its values (narrowing by
    the remaining length is exact there): kept in a union (another branch may admit a longer
    string: ``"123456"`` below), beside a pattern, past the bound, when unsatisfiable, and
    below an object with a subschema beside its properties."""
    union = {"anyOf": [SHORT, {"type": "string", "pattern": "^[0-9]+$"}]}
    schema = {
        "type": "object",
        "properties": {
            "a": SHORT,
            "b": {"type": "array", "items": {"type": ["string", "null"], "maxLength": 3}},
            "c": {"type": "array", "prefixItems": [{"type": "integer"}, SHORT]},
            "d": {"type": "object", "additionalProperties": {**SHORT, "minLength": 2}},
            "e": {**SHORT, "description": "annotations do not matter"},
            "f": union,
            "g": {**SHORT, "pattern": "^a+$"},
            "h": {"type": "string", "maxLength": 33},
            "i": {"type": "string", "minLength": 6, "maxLength": 5},
            "j": {"type": "object", "properties": {"x": SHORT}, "anyOf": [{"required": ["x"]}]},
        },
    }
    props = without_short_max_lengths(schema)["properties"]
    assert props["a"] == {"type": "string"}
    assert props["b"]["items"] == {"type": ["string", "null"]}
    assert props["c"]["prefixItems"][1] == {"type": "string"}
    assert props["d"]["additionalProperties"] == {"type": "string", "minLength": 2}
    assert "maxLength" not in props["e"]
    for name in "fghij":
        assert props[name] == schema["properties"][name], name
    assert schema["properties"]["a"] == SHORT  # the input is left as it was
    assert without_short_max_lengths(SHORT) == {"type": "string"}


def test_the_fit_table_counts_characters(vocab: TokenVocab) -> None:
    table = LooseMasks(vocab)
    ids = {data: t for t, data in enumerate(vocab.token_bytes) if data}
    word, accented, quoted = ids[b"abc"], ids["é".encode()], ids[b'",']
    assert vocab.token_bytes[table.probe[0]] == b"a" and len(table.probe) == 33
    assert not is_token_allowed(table.rows, 2, word) and is_token_allowed(table.rows, 3, word)
    assert is_token_allowed(table.rows, 1, accented) and not is_token_allowed(
        table.rows, 0, accented
    )
    assert all(is_token_allowed(table.rows, k, quoted) for k in range(33))


SCHEMAS = [
    {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 7},
            "code": {"type": "string", "maxLength": 1},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "uniqueItems": True,
            },
        },
        "required": ["name", "code", "tags"],
        "additionalProperties": False,
    },
]
TEXTS = [
    ['["abcd","é€z","a\\nb"]', '["x","","yz "]'],
    ['{"name":"Grace H","code":"Q","tags":["computer sc","naval"]}',
     '{"name":"ab","code":"","tags":["x\\"y","😀😀😀"]}'],
]  # fmt: skip
# The second schema as a tool's parameters, called in ``auto`` mode after some text.
TOOLS = json.dumps({"mode": "auto", "parallel": False,
                    "tools": [{"name": "record", "parameters": SCHEMAS[1]}]})  # fmt: skip
CONSTRAINTS = [
    *(Constraint.from_params(json_schema=schema) for schema in SCHEMAS),
    Constraint.from_params(tool_calls=TOOLS),
]
TEXTS.append(["Sure. " + format_tool_call("record", TEXTS[1][0])])


def _bits(mask: torch.Tensor) -> set[int]:
    words = mask[0].tolist()
    return {32 * w + b for w, word in enumerate(words) if word for b in range(32) if word >> b & 1}


@pytest.mark.parametrize("index", range(len(CONSTRAINTS)))
def test_loose_masks_with_checks_decide_as_the_exact_grammar(
    index: int, compile_for: Any, tokenizer: Any, vocab: TokenVocab
) -> None:
    """At each position of valid outputs (tokenized as the model writes them): the loose mask
    holds every token of the exact one (llguidance on the schema with its bounds), a sample
    of the exact tokens passes ``check_token``, and each token the loose mask adds is refused
    by it, or is one the exact grammar takes spelled byte by byte (llguidance's mask at a full
    one-character string allows ``","`` but not ``"`` alone, which its parser then takes).
    Inside a bounded string what is added carries a quote or a backslash, but right after a
    backslash (the remaining length is not read there)."""
    compiled = compile_for("llguidance", CONSTRAINTS[index])
    exact_mask = allocate_bitmask(1, vocab.vocab_size)
    loose_mask = allocate_bitmask(1, vocab.vocab_size)
    byte_ids = {data: t for t, data in enumerate(vocab.token_bytes) if data and len(data) == 1}
    rng = random.Random(index)
    refused = 0
    for text in TEXTS[index]:
        m = compiled.new_matcher()
        assert m.loose_masks and isinstance(m, VerifiedMatcher) == (index > 0)
        done = b""
        for token in tokenizer.encode(text, add_special_tokens=False):
            m.fill_bitmask(exact_mask, 0)
            assert m.fill_bitmask_loose(loose_mask, 0)
            exact, loose = _bits(exact_mask), _bits(loose_mask)
            assert exact <= loose, text
            for t in rng.sample(sorted(exact), min(200, len(exact))):
                assert m.check_token(t) is None, (text, vocab.token_bytes[t])
            for t in loose - exact:
                data = vocab.token_bytes[t]
                assert data is not None
                if not done.endswith(b"\\"):
                    assert b'"' in data or b"\\" in data, (done, data)
                if m.check_token(t) is not None:
                    refused += 1
                    continue
                spelled = [byte_ids[bytes([b])] for b in data]
                assert m.fork().accept_tokens(spelled), (done, data)
            assert m.accept_token(token), (text, token)
            done += vocab.token_bytes[token] or b""
    assert refused > 0  # the superset is used, and checked, along the texts


def test_a_terminated_or_exact_only_matcher_fills_exactly(compile_for: Any, vocab: TokenVocab):
    """No loose mask without short bounds (a plain schema), nor once EOS was accepted."""
    plain = compile_for("llguidance", Constraint.from_params(json_schema={"type": "string"}))
    m = plain.new_matcher()
    mask = allocate_bitmask(1, vocab.vocab_size)
    assert not m.loose_masks and m.fill_bitmask_loose(mask, 0) is False
    bounded = compile_for("llguidance", Constraint.from_params(json_schema=SHORT)).new_matcher()
    assert bounded.accept_tokens(list(_encode(vocab, '"ab"')))
    assert bounded.accept_token(vocab.eos_token_ids[0])
    assert bounded.fill_bitmask_loose(mask, 0) is False
    assert _bits(mask) == set(vocab.eos_token_ids)


def _encode(vocab: TokenVocab, text: str) -> list[int]:
    return vocab.encode(text)


def test_a_token_that_ends_one_character_and_starts_another_is_checked() -> None:
    """Within a character (its lead byte taken) the remaining length is not read, so a token
    without a quote may still be too long there: it is checked exactly (a vocabulary whose
    tokens cross character boundaries; SmolLM2's do not)."""
    crossing = b"\x98\x80\xc3"  # the end of U+1F600 and the start of a two-byte character
    vocab = TokenVocab(
        BYTE_VOCAB.token_bytes + (crossing,),
        BYTE_VOCAB.eos_token_ids,
        encode=lambda text: list(text.encode()),
    )
    schema = {"type": "string", "maxLength": 3}
    m = get_backend("llguidance")(vocab).compile(Constraint.from_params(json_schema=schema))
    m = m.new_matcher()
    assert m.accept_tokens(list(b'"ab') + list("😀".encode()[:2]))
    mask = allocate_bitmask(1, vocab.vocab_size)
    assert m.fill_bitmask_loose(mask, 0)
    token = len(BYTE_VOCAB.token_bytes)
    assert is_token_allowed(mask, 0, token)  # the twin allows it: no bound there
    assert m.check_token(token) == "maxLength"  # a fourth character
    assert m.check_token(0x98) is None
