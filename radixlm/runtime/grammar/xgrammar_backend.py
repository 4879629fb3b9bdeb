"""The xgrammar backend (default): every constraint kind, pushdown automata, fast masks.

Notes on xgrammar 0.2.8:

- The tokenizer info is built from ``TokenVocab`` (raw bytes; special tokens are empty strings,
  which xgrammar treats as never-allowed) so both backends see the same vocabulary.
- With ``separators=(",", ":")`` it still emits ``", "`` inside its generic ``basic_array`` /
  ``basic_object`` rules (free-form JSON values); the compact mode patches those two rules.
- ``tool_calls`` compiles to a structural tag: each tool is a tag (``call_begin(name)``, the
  arguments' own JSON grammar as EBNF, ``CALL_END``); ``required`` is tags-with-separator (no
  other text), ``auto`` is triggered tags (free text until ``<tool_call>``).
- It reads a schema ``pattern`` / ``patternProperties`` key as a full match, where JSON Schema
  searches (its issue #838): each is given as ``patterns.as_full_match`` of it.
- Its JSON-schema ``pattern`` conversion (not its regex constraints) gets an optional group
  holding ``*`` / ``+`` wrong (``^(?:ab*)?a$`` accepts ``"ba"``); ``{0,1}`` is right, so
  schema patterns are given ``(...){0,1}`` for ``(...)?``.
- ``find_jump_forward_string`` raises when the forced text ends inside a UTF-8 character or
  after termination; both are treated as "nothing forced".
"""

from __future__ import annotations

import json
import re
import time

import torch
import xgrammar as xgr
from xgrammar import structural_tag as st

from radixlm.runtime.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    register_backend,
)
from radixlm.runtime.grammar.bitmask import fill_bitmask_tokens
from radixlm.runtime.grammar.constraint import (
    CONSTRAINT_KINDS,
    MAX_JSON_WHITESPACE,
    Constraint,
    choices_regex,
    parse_choices,
)
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.patterns import as_full_match, map_patterns, regex_syntax_positions
from radixlm.runtime.grammar.strict import XGRAMMAR_SUPPORT, prepared_schema_text
from radixlm.runtime.grammar.verified import with_verifier
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.tool_calls import (
    CALL_END,
    SEPARATOR,
    TRIGGER,
    ToolCallsSpec,
    call_begin,
)

_COMPACT = (",", ":")
_BUILTIN_SEPARATOR_RULE = re.compile(r"^(basic_(?:array_items|object_properties)\w* ::= .*)$", re.M)
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def _clean(exc: BaseException) -> str:
    """xgrammar's C++ message without its timestamp / source-location prefix."""
    return _LOG_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__


def _schema_pattern(pattern: str) -> str:
    """A schema ``pattern`` / ``patternProperties`` key as xgrammar must get it: searched
    (``as_full_match``), optional groups bounded."""
    return optional_groups_bounded(as_full_match(pattern))


def optional_groups_bounded(pattern: str) -> str:
    """``pattern`` with every ``)?`` (an optional group) written ``){0,1}`` (same language);
    escapes and character classes are left alone."""
    cuts = [i for i in regex_syntax_positions(pattern) if pattern[i : i + 2] == ")?"]
    out, last = [], 0
    for i in cuts:
        out += [pattern[last:i], "){0,1}"]
        last = i + 2
    return "".join([*out, pattern[last:]])


def _compact_builtin_json(ebnf: str) -> str:
    return _BUILTIN_SEPARATOR_RULE.sub(lambda m: m.group(1).replace('", "', '","'), ebnf)


class XGrammarCompiled(CompiledGrammar):
    def __init__(
        self,
        constraint: Constraint,
        vocab: TokenVocab,
        compiled: xgr.CompiledGrammar,
        compile_time_s: float,
    ) -> None:
        super().__init__(constraint, "xgrammar", vocab, compile_time_s)
        self.compiled = compiled

    def _make_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.vocab, xgr.GrammarMatcher(self.compiled))


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, vocab: TokenVocab, matcher: xgr.GrammarMatcher, num_accepted: int = 0):
        super().__init__(vocab)
        self._m = matcher
        self._num_accepted = num_accepted

    @property
    def num_accepted(self) -> int:
        return self._num_accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():
            fill_bitmask_tokens(bitmask, row, self.vocab.eos_token_ids)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab.vocab_size or self._m.is_terminated():
            return False
        ok = bool(self._m.accept_token(token_id))
        self._num_accepted += ok
        return ok

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def is_completed(self) -> bool:
        return bool(self._m.is_terminated() or self._m.is_completed())

    def rollback(self, num_tokens: int) -> None:
        self._check_rollback(num_tokens)
        if num_tokens:
            self._m.rollback(num_tokens)
            self._num_accepted -= num_tokens

    def fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.vocab, self._m.fork(), self._num_accepted)

    def forced_bytes(self) -> bytes:
        if self.is_completed():
            return b""
        try:
            return self._m.find_jump_forward_string().encode()
        except (UnicodeDecodeError, RuntimeError):
            return b""


@register_backend
class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    kinds = frozenset(CONSTRAINT_KINDS)
    schema_support = XGRAMMAR_SUPPORT

    def __init__(self, vocab: TokenVocab, *, compile_threads: int = 2) -> None:
        super().__init__(vocab)
        encoded = [b if b is not None else b"" for b in vocab.token_bytes]
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded,
            xgr.VocabType.RAW,
            vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.eos_token_ids),
        )
        # NOTE: the manager caches compiled grammars; xgrammar's own unbounded cache is off.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=compile_threads, cache_enabled=False
        )

    def grammar(self, c: Constraint) -> xgr.Grammar:
        """The tokenizer-independent grammar of ``c`` (cheap: parsing only)."""
        try:
            if c.kind in ("json_schema", "json_object"):
                return self._json_grammar(c)
            if c.kind == "regex":
                return xgr.Grammar.from_regex(c.spec)
            if c.kind == "ebnf":
                return xgr.Grammar.from_ebnf(c.spec)
            if c.kind == "tool_calls":
                return self._tool_calls_grammar(c)
            return xgr.Grammar.from_regex(choices_regex(parse_choices(c.spec)))
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types
            raise GrammarError(f"invalid {c.kind}: {_clean(exc)}") from None

    @staticmethod
    def _json_grammar(c: Constraint) -> xgr.Grammar:
        schema = '{"type":"object"}'
        if c.kind == "json_schema":
            parsed = map_patterns(json.loads(prepared_schema_text(c.spec)), _schema_pattern)
            schema = json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)
        if c.whitespace == "any":
            return xgr.Grammar.from_json_schema(
                schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=_COMPACT)
        text = str(grammar)
        patched = _compact_builtin_json(text)
        return grammar if patched == text else xgr.Grammar.from_ebnf(patched)

    @classmethod
    def _tool_calls_grammar(cls, c: Constraint) -> xgr.Grammar:
        spec = ToolCallsSpec.from_json(c.spec)
        tags = []
        for tool in spec.tools:
            args = Constraint("json_schema", tool.parameters, c.best_effort, c.whitespace)
            content = st.GrammarFormat(grammar=str(cls._json_grammar(args)))
            tags.append(st.TagFormat(begin=call_begin(tool.name), content=content, end=CALL_END))
        stop_after_first = not spec.parallel
        fmt: st.TagsWithSeparatorFormat | st.TriggeredTagsFormat
        if spec.mode == "required":
            fmt = st.TagsWithSeparatorFormat(
                tags=tags, separator=SEPARATOR, at_least_one=True, stop_after_first=stop_after_first
            )
        else:
            fmt = st.TriggeredTagsFormat(
                triggers=[TRIGGER], tags=tags, stop_after_first=stop_after_first
            )
        return xgr.Grammar.from_structural_tag(st.StructuralTag(format=fmt))

    def _validate_syntax(self, constraint: Constraint) -> None:
        self.grammar(constraint)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        start = time.perf_counter()
        self.check_semantics(constraint)
        grammar = self.grammar(constraint)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(f"invalid {constraint.kind}: {_clean(exc)}") from None
        return with_verifier(
            XGrammarCompiled(constraint, self.vocab, compiled, time.perf_counter() - start)
        )
