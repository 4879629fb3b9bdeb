"""Incremental detokenizer tests on small tokenizers built in memory (no model hub):

- ``byte_level``: GPT-2 style byte-level BPE (multi-byte chars split across tokens);
- ``metaspace``: SentencePiece-style ``▁`` tokens whose decoder drops the leading space;
- ``llama``: Llama-style characters + ``<0xNN>`` byte-fallback tokens, strip-one-space decoder.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixlm.runtime.detokenizer import IncrementalDetokenizer, stop_token_hit
from radixlm.runtime.sampling_params import SamplingParams

torch.set_num_threads(1)

CORPUS = [
    "héllo 世界 🙂 hello world",
    "the quick brown fox jumps over the lazy dog",
    "naïve café résumé 日本語 テキスト",
    "emoji 🙂🙃 party 🎉 hello",
    "hello hello héllo world of tokens",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
ALPHABET = list("abdehlorw .\n") + ["é", "世", "界", "🙂", "ñ", "語"]


@functools.cache
def tokenizer(kind: str) -> PreTrainedTokenizerFast:
    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(CORPUS * 5, trainer)
    elif kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        trainer = trainers.BpeTrainer(
            vocab_size=200,
            special_tokens=SPECIALS,
            show_progress=False,
            initial_alphabet=ALPHABET,
        )
        tok.train_from_iterator(CORPUS * 5, trainer)
    else:
        assert kind == "llama"
        vocab = {s: i for i, s in enumerate(SPECIALS)}
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
        for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz.é", "▁h", "▁he", "lo", "▁w", "or"]:
            vocab[piece] = len(vocab)
        merges = [("▁", "h"), ("▁h", "e"), ("l", "o"), ("▁", "w"), ("o", "r")]
        tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_end|>"],
    )


KINDS = ["byte_level", "metaspace", "llama"]


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def reference(
    tok: PreTrainedTokenizerFast, prompt: Sequence[int], ids: Sequence[int], skip: bool = True
) -> str:
    """What the output text must be: the decode of (5 context tokens + output) minus the
    decode of the context (equals ``decode(ids)`` for byte-level tokenizers)."""
    ctx = list(prompt[-5:])

    def dec(x: list[int]) -> str:
        return tok.decode(x, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    return dec(ctx + list(ids))[len(dec(ctx)) :]


def stream(
    tok: PreTrainedTokenizerFast,
    prompt: Sequence[int],
    ids: Sequence[int],
    params: SamplingParams | None = None,
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, params or SamplingParams())
    deltas = []
    for t in ids:
        deltas.append(detok.append(t))
        assert detok.text == "".join(deltas)
        if detok.stopped:
            break
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return deltas, detok


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Reference: scan one character at a time; the first stop string to complete wins."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return end - len(stop), stop
    return None


texts = st.text(alphabet=st.sampled_from(ALPHABET), max_size=30)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(prompt_text=texts, text=texts, data=st.data())
def test_stream_equals_decode(kind: str, prompt_text: str, text: str, data: st.DataObject) -> None:
    tok = tokenizer(kind)
    prompt, ids = encode(tok, prompt_text), encode(tok, text)
    special = [tok.convert_tokens_to_ids(s) for s in ("</s>", "<|im_end|>")]
    # Special tokens go between characters (inside a character's bytes they make U+FFFD).
    boundaries = [i for i in range(len(ids) + 1) if not tok.decode(ids[:i]).endswith("\ufffd")]
    for pos in sorted(data.draw(st.lists(st.sampled_from(boundaries), max_size=2)))[::-1]:
        ids.insert(pos, data.draw(st.sampled_from(special)))
    skip = data.draw(st.booleans())
    deltas, detok = stream(tok, prompt, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == reference(tok, prompt, ids, skip)
    assert not any("\ufffd" in d for d in deltas)
    assert not detok.stopped
    if kind == "byte_level":
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 299), max_size=30), prompt=st.lists(st.integers(4, 299)))
def test_arbitrary_ids_still_concatenate_to_decode(ids: list[int], prompt: list[int]) -> None:
    """Invalid UTF-8 (random bytes) shows up as U+FFFD, but nothing is lost or duplicated."""
    tok = tokenizer("byte_level")
    deltas, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == reference(tok, prompt, ids)


@pytest.mark.parametrize("kind", ["byte_level", "llama"])
def test_multibyte_chars_are_never_split(kind: str) -> None:
    tok = tokenizer(kind)
    text = "世界🙂 héllo 語"
    ids = encode(tok, text)
    assert len(ids) > len(text)  # some characters really span several tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas, _ = stream(tok, [], ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # bytes were held back at least once


@pytest.mark.parametrize("kind", ["metaspace", "llama"])
def test_leading_space_after_prompt(kind: str) -> None:
    tok = tokenizer(kind)
    prompt, ids = encode(tok, "hello"), encode(tok, "world hello")
    assert tok.decode(ids) == "world hello"  # decoding alone loses the word's leading space
    deltas, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == " world hello"
    assert deltas[0].startswith(" w")


def char_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per character (byte-level): stop strings then span several tokens."""
    return [i for ch in text for i in encode(tok, ch)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(include: bool) -> None:
    tok = tokenizer("byte_level")
    ids = char_ids(tok, "hello wxyz there")
    params = SamplingParams(stop=["wxyz"], include_stop_str_in_output=include)
    deltas, detok = stream(tok, [], ids, params)
    expected = "hello wxyz" if include else "hello "
    assert "".join(deltas) == detok.text == expected
    assert detok.stopped and detok.stop_reason == "wxyz"
    if not include:
        assert not any(c in d for d in deltas for c in "wxyz")  # no partial leak either
    assert detok.append(encode(tok, "a")[0]) == "" and detok.finish() == ""
    assert detok.text == expected


def test_partial_stop_prefix_is_released_when_it_diverges() -> None:
    tok = tokenizer("byte_level")
    ids = char_ids(tok, "abxab")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["abc"]))
    deltas = [detok.append(t) for t in ids]
    assert deltas == ["", "", "abx", "", ""]
    assert detok.finish() == "ab"
    assert detok.text == "abxab" and not detok.stopped


@pytest.mark.parametrize(
    ("text", "stops", "expected", "reason"),
    [
        ("hello world", ["world", "lo"], "hel", "lo"),
        ("hello world", ["lo", "world"], "hel", "lo"),
        ("xabcd", ["abcd", "bc"], "xa", "bc"),  # "bc" completes first
        ("xabc", ["abc", "bc"], "x", "abc"),  # both complete together: earliest start
        ("no stop here", ["zzz"], "no stop here", None),
    ],
)
def test_multiple_stop_strings_first_completed_wins(
    text: str, stops: list[str], expected: str, reason: str | None
) -> None:
    tok = tokenizer("byte_level")
    for ids in (char_ids(tok, text), encode(tok, text)):  # independent of tokenization
        deltas, detok = stream(tok, [], ids, SamplingParams(stop=stops))
        assert "".join(deltas) == expected
        assert detok.stop_reason == reason and detok.stopped == (reason is not None)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(
    text=texts,
    stops=st.lists(st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
)
def test_stop_strings_match_char_scan(
    kind: str, text: str, stops: list[str], include: bool
) -> None:
    tok = tokenizer(kind)
    prompt = encode(tok, "hello")
    ids = encode(tok, text)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, detok = stream(tok, prompt, ids, params)
    full = reference(tok, prompt, ids)
    hit = first_stop(full, stops)
    if hit is None:
        assert "".join(deltas) == full and not detok.stopped
    else:
        start, stop = hit
        assert "".join(deltas) == full[: start + len(stop) if include else start]
        assert detok.stopped and detok.stop_reason == stop
    assert not any("\ufffd" in d for d in deltas)


def test_skip_special_tokens() -> None:
    tok = tokenizer("byte_level")
    eos = tok.convert_tokens_to_ids("</s>")
    ids = [*encode(tok, "hello"), eos, *encode(tok, " world")]
    deltas, _ = stream(tok, [], ids, SamplingParams(skip_special_tokens=True))
    assert "".join(deltas) == "hello world"
    deltas, _ = stream(tok, [], ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "hello</s> world"


def test_decode_window_stays_small() -> None:
    tok = tokenizer("byte_level")
    detok = IncrementalDetokenizer(tok, encode(tok, "hello world"), SamplingParams())
    ids = encode(tok, "the quick brown fox 世界 🙂 " * 40)
    for t in ids:
        detok.append(t)
        assert len(detok._ids) <= 8  # only the window is kept and decoded
    detok.finish()
    assert detok.text == tok.decode(ids)


def test_stop_token_hit() -> None:
    p = SamplingParams(stop_token_ids=[7], min_new_tokens=2)
    assert stop_token_hit(7, p, [2], 1) is None  # before min_new_tokens
    assert stop_token_hit(7, p, [2], 3) == 7
    assert stop_token_hit(2, p, [2], 3) == 2
    assert stop_token_hit(5, p, [2], 3) is None
    assert stop_token_hit(2, SamplingParams(ignore_eos=True), [2], 3) is None


# ---- stop_regex -------------------------------------------------------------------------------


def first_regex_stop(
    text: str, patterns: Sequence[str], stops: Sequence[str] = ()
) -> tuple[int, str] | None:
    """Reference: grow the text one character at a time; the first stop (a stop string ending
    here, else a pattern found in the text so far) wins. Returns (output length, reason)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return end - len(stop), stop
        for p in patterns:
            if re.search(p, text[:end]):
                return end, p
    return None


@pytest.mark.parametrize(
    ("text", "patterns", "expected"),
    [
        ("Answer: 42 apples", [r"\d+"], "Answer: 4"),  # first match to complete: one digit
        ("Answer: 42 apples", [r"\d+ "], "Answer: 42 "),
        ("abc. def. ghi", [r"\.\s"], "abc. "),
        ("x = 1;\ny = 2;", [r";\n", "y"], "x = 1;\n"),
        ("the end here", [r"\bend\b"], "the end"),  # \b at the end of the text so far
        ("no match", [r"\d"], "no match"),
    ],
)
def test_stop_regex_keeps_the_match_and_nothing_after(
    text: str, patterns: list[str], expected: str
) -> None:
    tok = tokenizer("byte_level")
    hit = first_regex_stop(text, patterns)
    want = text if hit is None else text[: hit[0]]
    assert want == expected
    for ids in (char_ids(tok, text), encode(tok, text)):  # independent of tokenization
        deltas, detok = stream(tok, [], ids, SamplingParams(stop_regex=patterns))
        assert "".join(deltas) == detok.text == expected
        assert detok.stopped == (hit is not None)
        if hit is not None:
            assert detok.stop_reason == hit[1]
            assert detok.append(encode(tok, "a")[0]) == "" and detok.finish() == ""


regexes = st.sampled_from([r"\d", r"lo+", r"o\s", r"[é世]", r"h.l", r"(ab|ra)", r"w\b", r"\n"])


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(
    text=texts,
    patterns=st.lists(regexes, min_size=1, max_size=2),
    stops=st.lists(st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=3), max_size=2),
)
def test_stop_regex_matches_char_scan(
    kind: str, text: str, patterns: list[str], stops: list[str]
) -> None:
    """Against a character-by-character reference, with stop strings mixed in; streamed deltas
    never hold text that the final output does not."""
    tok = tokenizer(kind)
    prompt = encode(tok, "hello")
    ids = encode(tok, text)
    deltas, detok = stream(tok, prompt, ids, SamplingParams(stop=stops, stop_regex=patterns))
    full = reference(tok, prompt, ids)
    hit = first_regex_stop(full, patterns, stops)
    if hit is None:
        assert "".join(deltas) == full and not detok.stopped
    else:
        assert "".join(deltas) == full[: hit[0]]
        assert detok.stopped and detok.stop_reason == hit[1]
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("(", "invalid pattern"),
        ("a*", "matches the empty string"),
        ([""], "non-empty"),
        (["x"] * 33, "at most 32"),
        ("a" * 300, "over 256 bytes"),
        (3, "str or a list"),
    ],
)
def test_stop_regex_validation(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        SamplingParams(stop_regex=value)
    assert str(err.value).startswith("stop_regex")
    assert SamplingParams(stop_regex=r"\d").stop_regex == (r"\d",)
    assert SamplingParams(stop_regex=None).stop_regex == ()
