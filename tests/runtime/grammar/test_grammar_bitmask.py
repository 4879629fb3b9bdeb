"""Token vocabulary bytes and the bitmask helpers / batched apply."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grammar_helpers import EOS, VOCAB_SIZE

from radixlm.runtime.grammar.bitmask import (
    allocate_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    bitmask_to_bool,
    bitmask_width,
    fill_bitmask_tokens,
    is_token_allowed,
    set_bitmask_bits,
)
from radixlm.runtime.grammar.vocab import TokenVocab, decode_token


def test_vocab_bytes_match_xgrammar_decoding(tokenizer: Any, vocab: TokenVocab) -> None:
    import xgrammar as xgr

    decoded = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE).decoded_vocab
    specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert EOS in specials
    for i, data in enumerate(vocab.token_bytes):
        if i in specials:
            assert data is None
        else:
            assert data == decoded[i], i
    assert vocab.join(tokenizer.encode(" héllo {}\n\t中")) == " héllo {}\n\t中".encode()
    assert vocab.join([EOS]) is None
    # Every printable ASCII byte has a token of its own (some control / non-UTF-8 bytes don't).
    assert all(vocab.single_byte_ids[b] is not None for b in range(0x20, 0x7F))
    assert not vocab.has_all_single_bytes


def test_sentencepiece_style_tokens() -> None:
    assert decode_token("<0x0A>", "byte_fallback") == b"\n"
    assert decode_token("\u2581hello", "byte_fallback") == b" hello"
    assert decode_token("\u2581hi", "metaspace") == b" hi"
    assert decode_token("\u0120x", "byte_level") == b" x"


def test_vocab_rejects_inconsistent_eos() -> None:
    with pytest.raises(ValueError, match="EOS"):
        TokenVocab((b"a", None), (), encode=lambda s: [])
    with pytest.raises(ValueError, match="None"):
        TokenVocab((b"a", b"b"), (1,), encode=lambda s: [])


def test_bit_helpers_including_the_sign_bit() -> None:
    mask = allocate_bitmask(2, 70)
    assert mask.shape == (2, bitmask_width(70)) == (2, 3) and mask.dtype == torch.int32
    fill_bitmask_tokens(mask, 1, [0, 31, 63, 69])
    assert bitmask_to_bool(mask, 70)[1].nonzero().flatten().tolist() == [0, 31, 63, 69]
    assert bitmask_to_bool(mask, 70)[0].all()
    set_bitmask_bits(mask, 1, [31], allowed=False)
    set_bitmask_bits(mask, 1, [5], allowed=True)
    assert [t for t in range(70) if is_token_allowed(mask, 1, t)] == [0, 5, 63, 69]
    set_bitmask_bits(mask, 0, [31, 32], allowed=False)
    assert not is_token_allowed(mask, 0, 31) and is_token_allowed(mask, 0, 30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [0, 5, 6]])
def test_apply_matches_the_torch_twin(dtype: torch.dtype, rows: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 8, VOCAB_SIZE
    mask = torch.randint(-(2**31), 2**31 - 1, (batch, bitmask_width(vocab)), generator=gen)
    mask = mask.to(torch.int32)
    mask[:, ::3] = 0  # words allowing nothing (most of a grammar's row) and everything
    mask[:, 1::5] = -1
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    ours, twin = logits.clone(), logits.clone()
    apply_token_bitmask(ours, mask, rows)
    apply_token_bitmask_torch(twin, mask, rows)
    assert torch.equal(ours, twin)
    allowed = bitmask_to_bool(mask, vocab)
    selected = list(range(batch)) if rows is None else rows
    for r in range(batch):
        masked = torch.isinf(ours[r])
        if r in selected:
            assert torch.equal(masked, ~allowed[r])
            assert torch.equal(ours[r][allowed[r]], logits[r][allowed[r]])
        else:
            assert not masked.any()


def test_apply_checks_shapes_and_allows_a_larger_mask() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask(logits, torch.zeros(2, 1, dtype=torch.int32))
    mask = allocate_bitmask(4, 64)  # more rows than logits: the first rows are used
    fill_bitmask_tokens(mask, 1, [3])
    apply_token_bitmask(logits, mask)
    assert torch.isinf(logits[1]).sum() == 63 and not torch.isinf(logits[0]).any()
    apply_token_bitmask(logits, mask, rows=[])  # nothing to do
