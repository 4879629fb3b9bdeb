"""The outlines-core backend: constraints compiled to a regex, then a token-level DFA index.

Kinds: json_schema, json_object, regex, choices (no EBNF: regular languages only). JSON
``anyOf`` / nesting is bounded by what outlines' schema-to-regex conversion supports; arbitrary
JSON (json_object) is a very large DFA (seconds to compile).

Notes on outlines-core 0.2.14:

- Its DFA uses leftmost-first match semantics, and the index drops every continuation that
  leaves a full-match position through a non-matching one (``[0-9]+(\\.[0-9]+)?`` never allows
  the ``.`` after ``1``; ``a|ab`` never allows ``ab``). Anchoring the pattern, ``(?:R)$``,
  restores full-match semantics; the user's ``R`` is parsed on its own first, so the wrapper
  cannot change its meaning. An anchored pattern that matches the empty string has no
  "universal start state" there, so a one-byte sentinel goes first, ``\\x01(?:R)$``, and every
  matcher consumes it before anything else (it is never part of the output).
- It splices a schema ``pattern`` into its string regex, matched in full (``ab`` took only
  "ab"; ``^a`` did not compile), where JSON Schema searches: each is given as
  ``patterns.as_full_match`` of it, its wildcard ``UNESCAPED_TEXT`` (the regex reads the
  escaped text: a wildcard matching a backslash or quote would be unsound; see
  ``SchemaSupport.pattern_on_escaped_text``), so strings needing an escape are not generated
  around the match (stricter, never looser).
- ``Guide.advance(eos)`` raises even in a final state: EOS (any of the EOS ids) is handled here.
- Copying a ``Guide`` pickles its whole index (0.1 s for big ones): ``fork`` replays the
  accepted tokens on a fresh ``Guide`` instead (cheap: the index is shared).
"""

from __future__ import annotations

import json
import time

import outlines_core as oc
import torch

from radixlm.runtime.grammar.base import (
    CompiledGrammar,
    EosMatcher,
    GrammarBackend,
    register_backend,
)
from radixlm.runtime.grammar.bitmask import set_bitmask_bits
from radixlm.runtime.grammar.constraint import (
    MAX_JSON_WHITESPACE,
    Constraint,
    choices_regex,
    parse_choices,
)
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.patterns import UNESCAPED_TEXT, as_full_match, map_patterns
from radixlm.runtime.grammar.strict import OUTLINES_SUPPORT, prepared_schema_text
from radixlm.runtime.grammar.verified import with_verifier
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.tool_calls import CALL_END, SEPARATOR, ToolCallsSpec, call_begin

_MAX_ROLLBACK = 64  # Guide history; longer rollbacks replay from the start
_MAX_FORCED_BYTES = 4096
# Bytes most likely to be allowed first: finding two allowed bytes ends a forced-byte probe.
_PROBE_ORDER = tuple(range(0x20, 0x7F)) + tuple(range(0x20)) + tuple(range(0x7F, 0x100))
_BYTE_VOCAB_EOS = 256
_SENTINEL_BYTES = (0x01, 0x02, 0x03, 0x05, 0x07, 0x08)  # control bytes: any with a token


def _byte_vocabulary() -> oc.Vocabulary:
    """One token per byte: enough to parse any regex into an index cheaply (syntax check)."""
    return oc.Vocabulary(_BYTE_VOCAB_EOS, {bytes([b]): [b] for b in range(256)})


class OutlinesCompiled(CompiledGrammar):
    def __init__(
        self,
        constraint: Constraint,
        vocab: TokenVocab,
        regex: str,
        index: oc.Index,
        prefix: tuple[int, ...],
        compile_time_s: float,
    ) -> None:
        super().__init__(constraint, "outlines", vocab, compile_time_s)
        self.regex = regex
        self.index = index
        self.prefix = prefix  # sentinel token(s) every matcher consumes first
        self._forced: dict[int, int | None] = {}  # state -> its forced byte (memo)

    def _make_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)

    def forced_byte(self, state: int) -> int | None:
        """The only byte that can follow ``state`` (None if final or there is a choice)."""
        if state in self._forced:
            return self._forced[state]
        result = None
        if not self.index.is_final_state(state):
            found = self._allowed_first_bytes(state)
            result = found[0] if len(found) == 1 else None
        self._forced[state] = result
        return result

    def _allowed_first_bytes(self, state: int) -> list[int]:
        """Up to two distinct first bytes of the tokens allowed in ``state``. Single-byte tokens
        are probed first (two hits settle it); bytes without one (the vocabulary may lack some)
        are covered by scanning the allowed tokens, which is short in forced states."""
        single = self.vocab.single_byte_ids
        found: list[int] = []
        for b in _PROBE_ORDER:
            tok = single[b]
            if tok is not None and self.index.get_next_state(state, tok) is not None:
                found.append(b)
                if len(found) == 2:
                    return found
        if self.vocab.has_all_single_bytes:
            return found
        firsts = set(found)
        eos = set(self.vocab.eos_token_ids)
        for t in self.index.get_allowed_tokens(state) or []:
            data = self.vocab.token_bytes[t] if t not in eos else None
            if data:
                firsts.add(data[0])
                if len(firsts) == 2:
                    break
        return sorted(firsts)


class OutlinesMatcher(EosMatcher):
    """A ``Guide`` plus what it cannot do: EOS acceptance, every EOS id, fork, long rollback."""

    def __init__(self, compiled: OutlinesCompiled) -> None:
        super().__init__(compiled.vocab)
        self._compiled = compiled
        self._tokens: list[int] = []  # accepted, EOS and the sentinel prefix excluded
        self._extra_eos = compiled.vocab.eos_token_ids[1:]
        self._replay([])

    @property
    def _num_consumed(self) -> int:
        return len(self._tokens)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]  # [W]
        if words.dtype != torch.int32 or words.device.type != "cpu" or not words.is_contiguous():
            raise ValueError("bitmask rows must be contiguous int32 CPU memory")
        # NOTE: outlines writes through the raw pointer (and checks the size itself).
        self._guide.write_mask_into(words.data_ptr(), words.numel(), 4)
        if self._extra_eos and self._guide.is_finished():
            set_bitmask_bits(bitmask, row, self._extra_eos, allowed=True)

    def _accepting(self) -> bool:
        return bool(self._guide.is_finished())

    def _consume(self, token_id: int) -> bool:
        try:
            self._guide.advance(token_id, return_tokens=False)
        except (ValueError, OverflowError):
            return False
        self._tokens.append(token_id)
        return True

    def _rollback_consumed(self, num_tokens: int) -> None:
        if num_tokens <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(num_tokens)
            del self._tokens[-num_tokens:]
        else:
            self._replay(self._tokens[:-num_tokens])

    def _replay(self, tokens: list[int]) -> None:
        self._guide = oc.Guide(self._compiled.index, max_rollback=_MAX_ROLLBACK)
        for t in (*self._compiled.prefix, *tokens):
            self._guide.advance(t, return_tokens=False)
        self._tokens = list(tokens)

    def fork(self) -> OutlinesMatcher:
        child = OutlinesMatcher(self._compiled)
        child._replay(self._tokens)
        child._terminated = self._terminated
        return child

    def forced_bytes(self) -> bytes:
        if self.is_completed():
            return b""
        index = self._compiled.index
        single = self.vocab.single_byte_ids
        state = self._guide.get_state()
        out = bytearray()
        while len(out) < _MAX_FORCED_BYTES:
            b = self._compiled.forced_byte(state)
            tok = single[b] if b is not None else None
            if tok is None:
                break
            out.append(b)
            state = index.get_next_state(state, tok)
        return bytes(out)


def _searched(pattern: str) -> str:
    """A schema pattern as outlines must get it (see the module docstring)."""
    return as_full_match(pattern, UNESCAPED_TEXT)


@register_backend
class OutlinesBackend(GrammarBackend):
    name = "outlines"
    kinds = frozenset({"json_schema", "json_object", "regex", "choices", "tool_calls"})
    schema_support = OUTLINES_SUPPORT

    def __init__(self, vocab: TokenVocab) -> None:
        super().__init__(vocab)
        mapping: dict[bytes, list[int]] = {}
        for i, data in enumerate(vocab.token_bytes):
            if data is not None:
                mapping.setdefault(data, []).append(i)
        self.vocabulary = oc.Vocabulary(vocab.eos_token_ids[0], mapping)
        self._byte_vocabulary = _byte_vocabulary()
        # (byte, its token) that anchored patterns start with; None: vocabulary has none.
        self._sentinel: tuple[int, int] | None = next(
            ((b, t) for b in _SENTINEL_BYTES if (t := vocab.single_byte_ids[b]) is not None),
            None,
        )

    def regex(self, c: Constraint) -> str:
        """The (unanchored) regex that ``c`` compiles to."""
        if c.kind == "regex":
            return c.spec
        if c.kind == "choices":
            return choices_regex(parse_choices(c.spec))
        if c.kind == "tool_calls":
            return self._tool_calls_regex(c)
        schema = '{"type":"object"}'
        if c.kind == "json_schema":
            names = OUTLINES_SUPPORT.names_as_patterns  # False: the verifier checks names
            prepared = prepared_schema_text(c.spec, names_as_patterns=names)
            searched = map_patterns(json.loads(prepared), _searched)
            schema = json.dumps(searched, separators=(",", ":"), ensure_ascii=False)
        ws = "" if c.whitespace == "compact" else f"[ \\t\\n\\r]{{0,{MAX_JSON_WHITESPACE}}}"
        try:
            return oc.json_schema.build_regex_from_schema(schema, ws)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {c.kind} for the outlines backend: {exc}") from None

    def _tool_calls_regex(self, c: Constraint) -> str:
        """``required`` mode only: one call, or calls separated by ``SEPARATOR``. ``auto`` (free
        text until a trigger) has no practical regex (the text must exclude the trigger)."""
        spec = ToolCallsSpec.from_json(c.spec)
        if spec.mode != "required":
            raise GrammarError(
                "tool_calls in auto mode (tool_choice auto) is not supported by the outlines "
                "grammar backend; use tool_choice required / a named function, or xgrammar"
            )
        calls = []
        for tool in spec.tools:
            params = Constraint("json_schema", tool.parameters, c.best_effort, c.whitespace)
            args = self.regex(params)
            begin, end = choices_regex([call_begin(tool.name)]), choices_regex([CALL_END])
            calls.append(f"{begin}({args}){end}")
        call = "|".join(f"({x})" for x in calls)
        sep = choices_regex([SEPARATOR])
        return f"({call})({sep}({call}))*" if spec.parallel else f"({call})"

    def _validate_syntax(self, constraint: Constraint) -> None:
        regex = self.regex(constraint)
        if constraint.kind == "regex":
            self._check_regex(regex)

    def _check_regex(self, regex: str) -> None:
        try:
            oc.Index(regex, self._byte_vocabulary)
        except ValueError as exc:
            raise GrammarError(f"invalid regex: {exc}") from None

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        start = time.perf_counter()
        self.check_semantics(constraint)
        regex = self.regex(constraint)
        if constraint.kind == "regex":
            self._check_regex(regex)
        anchored = f"(?:{regex})$"
        prefix: tuple[int, ...] = ()
        if self._sentinel is not None:
            byte, token = self._sentinel
            anchored = f"\\x{byte:02x}{anchored}"
            prefix = (token,)
        try:
            index = oc.Index(anchored, self.vocabulary)
        except ValueError as exc:
            raise GrammarError(f"cannot compile {constraint.kind}: {exc}") from None
        elapsed = time.perf_counter() - start
        return with_verifier(
            OutlinesCompiled(constraint, self.vocab, anchored, index, prefix, elapsed)
        )
