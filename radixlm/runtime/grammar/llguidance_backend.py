"""The llguidance backend: JSON schemas, regexes, choices and tool calls compiled lazily.

llguidance (the Rust library behind Guidance, also offered by SGLang and vLLM) builds a
lexer/parser for the grammar and computes each token mask on demand, walking a token trie: a
compile costs milliseconds where xgrammar precomputes masks for every grammar position (seconds
for big schemas), and each mask costs tens to hundreds of microseconds.

Notes on llguidance 1.9:

- Strict by default: a JSON-schema keyword it does not implement is a compile error (we add the
  keywords it accepts but does not enforce as we need, see ``LLGUIDANCE_SUPPORT``). ``oneOf`` is
  an error unless ``coerce_one_of`` (generate it as ``anyOf``): we set it, since strict mode
  admits a ``oneOf`` only when its branches are proved disjoint (then the two agree).
- A matcher that ``consume_token``s a token the grammar forbids enters a permanent error
  state, so ``accept_token`` uses ``try_consume_tokens`` (one call; a refusal changes nothing).
  EOS is never passed to llguidance: this
  wrapper accepts it (when the text is a full match) and tracks termination itself, because
  llguidance also reports "stopped" for a grammar that can only end.
- Building a matcher parses the grammar (up to ~1.5 s for huge schemas); a compiled grammar
  keeps one template matcher and gives each sequence a ``deep_copy`` (cheap: the grammar is
  shared). ``validate`` builds that template and ``compile`` takes it, so it is built once.
- Special tokens and padding rows of the vocabulary are given llguidance's special-token form
  (``\\xff`` + a name) so that no grammar can produce them.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import numpy as np
import torch

from radixlm.runtime.grammar.base import (
    CompiledGrammar,
    EosMatcher,
    GrammarBackend,
    register_backend,
)
from radixlm.runtime.grammar.bitmask import bitmask_width, row_pointer
from radixlm.runtime.grammar.constraint import (
    MAX_JSON_WHITESPACE,
    Constraint,
    choices_regex,
    parse_choices,
)
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.patterns import map_patterns, positive_classes
from radixlm.runtime.grammar.schema_keywords import NON_ASSERTING
from radixlm.runtime.grammar.strict import LLGUIDANCE_SUPPORT, prepared_schema_text
from radixlm.runtime.grammar.verified import with_verifier
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.tool_calls import CALL_END, SEPARATOR, TRIGGER, ToolCallsSpec, call_begin

_MAX_VALIDATED = 8  # templates kept between validate and compile
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
_WHITESPACE = f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"


def exact_patterns(schema: str) -> str:
    """The prepared schema text with every negated class that excludes ``"`` or ``\\`` made
    positive (``patterns.positive_classes``): llguidance lets such a character through as its
    JSON escape (``[^"]`` admits ``\\"``). A class that cannot be rewritten is refused."""
    if "[^" not in schema:
        return schema

    def positive(pattern: str) -> str:
        out = positive_classes(pattern)
        if out is None:
            raise GrammarError(
                f"pattern {pattern!r}: a negated class excluding a quote or backslash that the "
                "llguidance backend cannot enforce exactly"
            )
        return out

    return json.dumps(map_patterns(json.loads(schema), positive), ensure_ascii=False)


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


def json_options(c: Constraint) -> dict[str, Any]:
    """llguidance's JSON compile options for a constraint's whitespace mode and strictness
    (``lenient``: ignore unimplemented keywords, for best effort only)."""
    common = {"coerce_one_of": True, "lenient": c.best_effort}
    if c.whitespace == "compact":
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", **common}
    return {"whitespace_flexible": True, "whitespace_pattern": _WHITESPACE, **common}


class _Vocabulary:
    """The object ``llguidance.TokenizerWrapper`` reads: token bytes, specials, an encoder."""

    def __init__(self, vocab: TokenVocab) -> None:
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = None
        self.tokens = [
            data if data is not None else b"\xff[special_%d]" % i
            for i, data in enumerate(vocab.token_bytes)
        ]
        self.special_token_ids = [i for i, data in enumerate(vocab.token_bytes) if data is None]
        self._encode = vocab.encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


def make_tokenizer(vocab: TokenVocab) -> llg.LLTokenizer:
    """llguidance's tokenizer for ``vocab`` (~0.2 s for a 49k vocabulary: build it once)."""
    wrapper = llg.TokenizerWrapper(_Vocabulary(vocab))
    return llg.LLTokenizer(wrapper, n_vocab=vocab.vocab_size, eos_token=list(vocab.eos_token_ids))


class LLGuidanceCompiled(CompiledGrammar):
    def __init__(
        self,
        constraint: Constraint,
        vocab: TokenVocab,
        template: llg.LLMatcher,
        seconds: float,
        loose: tuple[llg.LLMatcher, LooseMasks] | None = None,
    ) -> None:
        super().__init__(constraint, "llguidance", vocab, seconds)
        self._template = template
        self._loose = loose  # the twin without short string bounds, and the fit table

    def _make_matcher(self) -> LLGuidanceMatcher:
        if self._loose is None:
            return LLGuidanceMatcher(self.vocab, self._template.deep_copy())
        twin, table = self._loose
        return LLGuidanceMatcher(self.vocab, self._template.deep_copy(), twin=twin.deep_copy(),
                                 table=table)  # fmt: skip


class LLGuidanceMatcher(EosMatcher):
    """llguidance's matcher. With ``twin`` (``LooseMasks``) it also feeds every consumed token
    to the twin, whose masks ``fill_bitmask_loose`` gives; ``fill_bitmask`` stays exact."""

    def __init__(
        self,
        vocab: TokenVocab,
        matcher: llg.LLMatcher,
        accepted: int = 0,
        terminated: bool = False,
        twin: llg.LLMatcher | None = None,
        table: LooseMasks | None = None,
    ) -> None:
        super().__init__(vocab, terminated)
        self._m = matcher
        self._accepted = accepted  # tokens given to llguidance (EOS excluded)
        self._twin = twin if table is not None else None
        self._table = table
        # Set by ``fill_bitmask_loose`` for this state (any accept or rollback clears it).
        self._plain_exact = False

    @property
    def loose_masks(self) -> bool:
        return self._twin is not None

    @property
    def _num_consumed(self) -> int:
        return self._accepted

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"llguidance matcher error: {self._m.get_error()}")

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        # NOTE: through the row's address (llguidance.torch's helper slices a row view first).
        self._m.unsafe_compute_mask_ptr(*row_pointer(bitmask, row))
        self._check()

    def fill_bitmask_loose(self, bitmask: torch.Tensor, row: int) -> bool:
        twin, table = self._twin, self._table
        if twin is None or table is None or self._terminated:
            self.fill_bitmask(bitmask, row)
            return False
        twin.unsafe_compute_mask_ptr(*row_pointer(bitmask, row))
        if twin.is_error():
            self._twin = None  # the twin lost track: exact masks from here on
            self.fill_bitmask(bitmask, row)
            return False
        left = self._m.validate_tokens(table.probe)
        room = twin.validate_tokens(table.probe)
        if left < room:  # inside a bounded plain string
            table.narrow(bitmask, row, left)
        # Whether the tokens without a quote or backslash are the exact ones here (then only
        # the others need ``check_token``'s exact look): inside a string that the twin bounds
        # as the exact grammar does, or outside any string (no such token opens one); not
        # right after a backslash or within a character (no length is read there).
        self._plain_exact = room > 0 or not (
            twin.validate_tokens(table.after_escape) or twin.validate_tokens(table.within_char)
        )
        return True

    def check_token(self, token_id: int) -> str | None:
        if self._terminated or not 0 <= token_id < self.vocab.vocab_size:
            return "maxLength"
        if token_id in self._eos:
            return None if self._accepting() else "maxLength"
        table = self._table
        if self._plain_exact and table is not None and not table.quoted[token_id]:
            return None  # the loose mask that allowed it was exact for such tokens
        return None if self._m.validate_tokens([token_id]) == 1 else "maxLength"

    def _accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def _consume(self, token_id: int) -> bool:
        # NOTE: unlike consume_token, a refused token leaves the matcher usable.
        if self._m.try_consume_tokens([token_id]) != 1:
            self._check()
            return False
        self._accepted += 1
        self._feed_twin([token_id])
        return True

    def _feed_twin(self, ids: list[int]) -> None:
        """The twin takes what the exact matcher took (a relaxation: it always can; if not,
        it is dropped and the masks are exact from here on)."""
        self._plain_exact = False
        if self._twin is not None and self._twin.try_consume_tokens(ids) != len(ids):
            self._twin = None

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        # One call for a run (jump-forward's forced tokens): ~15 us a token less than one at a
        # time. EOS, a terminated matcher and out-of-range ids take the general path.
        ids = list(token_ids)
        if (
            len(ids) < 2
            or self._terminated
            or any(t in self._eos or not 0 <= t < self.vocab.vocab_size for t in ids)
        ):
            return super().accept_tokens(ids)
        n = self._m.try_consume_tokens(ids)
        if n != len(ids):
            if n:
                self._m.rollback(n)
            self._check()
            return False
        self._accepted += n
        self._feed_twin(ids)
        return True

    def _rollback_consumed(self, num_tokens: int) -> None:
        if not self._m.rollback(num_tokens):
            self._check()
        self._accepted -= num_tokens
        self._plain_exact = False
        if self._twin is not None and not self._twin.rollback(num_tokens):
            self._twin = None

    def fork(self) -> LLGuidanceMatcher:
        twin = self._twin.deep_copy() if self._twin is not None else None
        return LLGuidanceMatcher(self.vocab, self._m.deep_copy(), self._accepted, self._terminated,
                                 twin, self._table)  # fmt: skip

    def forced_bytes(self) -> bytes:
        if self.is_completed():
            return b""
        return bytes(self._m.compute_ff_bytes())

    def only_eos_allowed(self) -> bool:
        # llguidance's ``is_stopped``: nothing but EOS can follow (no mask fill, ~1 us instead
        # of ~30); when it says no, the mask decides (a complete grammar may still continue).
        if self._terminated:
            return True
        if self._accepting() and self._m.is_stopped() and not self._m.is_error():
            return True
        return super().only_eos_allowed()


@register_backend
class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    kinds = frozenset({"json_schema", "json_object", "regex", "choices", "tool_calls"})
    schema_support = LLGUIDANCE_SUPPORT

    def __init__(self, vocab: TokenVocab) -> None:
        super().__init__(vocab)
        self.tokenizer = make_tokenizer(vocab)
        self._lock = threading.Lock()
        # Templates built by validate, until their compile takes them (LRU: a validated
        # constraint that is never compiled, e.g. a tool's parameters, ages out).
        self._validated: OrderedDict[Constraint, llg.LLMatcher] = OrderedDict()
        self._table: LooseMasks | None = None  # built by the first compile that needs it

    def grammar(self, c: Constraint) -> str:
        """llguidance's grammar text for ``c`` (cheap: no parsing yet)."""
        if c.kind == "json_schema":
            return self._json_grammar(exact_patterns(prepared_schema_text(c.spec)), c)
        if c.kind == "json_object":
            return self._json_grammar('{"type":"object"}', c)
        if c.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(c.spec)
        if c.kind == "choices":
            return llg.LLMatcher.grammar_from_regex(choices_regex(parse_choices(c.spec)))
        if c.kind == "tool_calls":
            return llg.LLMatcher.grammar_from_lark(self._tool_calls_lark(c))
        raise GrammarError(f"{c.kind} constraints are not supported by the llguidance backend")

    @staticmethod
    def _json_grammar(schema: str, whitespace: str) -> str:
        try:
            return llg.LLMatcher.grammar_from_json_schema(
                schema, overrides=json_options(whitespace)
            )
        except ValueError as exc:
            raise GrammarError(f"invalid json_schema: {exc}") from None

    @staticmethod
    def _tool_calls_lark(c: Constraint, loose: bool = False) -> str:
        """A Lark grammar of the calls: each ``call_begin(name)``, the arguments as an inline
        ``%json`` schema, ``CALL_END``. In ``auto`` mode a lazy rule takes the text up to and
        including the first trigger (the call's remaining head follows it), and the text after
        the last call is any text without the trigger (derivre's ``&`` / ``~`` operators).
        ``loose``: the arguments without their short string bounds (``LooseMasks``)."""
        spec = ToolCallsSpec.from_json(c.spec)
        options = json_options(c)
        auto = spec.mode == "auto"
        rules = []
        for i, tool in enumerate(spec.tools):
            schema = json.loads(exact_patterns(prepared_schema_text(tool.parameters)))
            if loose:
                schema = without_short_max_lengths(schema)
            schema = {**schema, "x-guidance": options} if isinstance(schema, dict) else {}
            head = call_begin(tool.name)[len(TRIGGER) if auto else 0 :]
            rules.append(f"call_{i}: {json.dumps(head)} %json {json.dumps(schema)} "
                         f"{json.dumps(CALL_END)}")  # fmt: skip
        names = " | ".join(f"call_{i}" for i in range(len(spec.tools)))
        if not auto:
            sep = json.dumps(SEPARATOR)
            start = f"start: call ({sep} call)*" if spec.parallel else "start: call"
            return "\n".join([start, f"call: {names}", *rules])
        trigger = _regex_literal(TRIGGER)
        return "\n".join(
            [
                f"start: (pre call){'*' if spec.parallel else '?'} TEXT?",
                f"call: {names}",
                *rules,
                f"pre[lazy]: /(?s:.*){trigger}/",
                f"TEXT: /(?s:.+)/ & ~/(?s:.*){trigger}(?s:.*)/",
            ]
        )

    def _build(self, c: Constraint) -> llg.LLMatcher:
        """A template matcher for ``c``: llguidance parses the grammar and reports what is wrong
        with it (unimplemented keywords, unsatisfiable schemas, regex syntax) as
        ``GrammarError``."""
        template = llg.LLMatcher(self.tokenizer, self.grammar(c), log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {c.kind}: {_clean(template.get_error())}")
        return template

    def _validate_syntax(self, constraint: Constraint) -> None:
        """Build the matcher (checking without building costs as much: ~1.5 s for the largest
        schemas) and keep it for the ``compile`` that follows a validation."""
        template = self._build(constraint)
        with self._lock:
            self._validated[constraint] = template
            while len(self._validated) > _MAX_VALIDATED:
                self._validated.popitem(last=False)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        start = time.perf_counter()
        self.check_semantics(constraint)
        with self._lock:
            template = self._validated.pop(constraint, None)
        if template is None:
            template = self._build(constraint)
        loose = self._loose_twin(constraint)
        seconds = time.perf_counter() - start
        return with_verifier(LLGuidanceCompiled(constraint, self.vocab, template, seconds, loose))

    def _loose_twin(self, c: Constraint) -> tuple[llg.LLMatcher, LooseMasks] | None:
        """For a JSON schema (or tools' parameters) with short plain string bounds: the twin
        template without them and the fit table (``LooseMasks``); None otherwise."""
        if c.kind == "json_schema":
            schema = json.loads(exact_patterns(prepared_schema_text(c.spec)))
            loose = without_short_max_lengths(schema)
            if loose == schema:
                return None
            grammar = self._json_grammar(json.dumps(loose), c)
        elif c.kind == "tool_calls":
            lark = self._tool_calls_lark(c, loose=True)
            if lark == self._tool_calls_lark(c):
                return None
            grammar = llg.LLMatcher.grammar_from_lark(lark)
        else:
            return None
        with self._lock:
            if self._table is None:
                self._table = LooseMasks(self.vocab)
            table = self._table
        if not table.available():
            return None
        twin = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        return None if twin.is_error() else (twin, table)


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def _regex_literal(text: str) -> str:
    return "".join(f"\\{ch}" if ch in _REGEX_META else ch for ch in text)


def _clean(message: str) -> str:
    """The first line of llguidance's error (it appends parser state and the grammar)."""
    return message.strip().split("\n<state>")[0].strip() or "llguidance error"
