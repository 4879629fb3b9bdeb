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
import torch

from radixlm.runtime.grammar.base import (
    CompiledGrammar,
    EosMatcher,
    GrammarBackend,
    register_backend,
)
from radixlm.runtime.grammar.bitmask import row_pointer
from radixlm.runtime.grammar.constraint import (
    MAX_JSON_WHITESPACE,
    Constraint,
    choices_regex,
    parse_choices,
)
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.loose_masks import LooseMasks, without_short_max_lengths
from radixlm.runtime.grammar.patterns import map_patterns, positive_classes
from radixlm.runtime.grammar.strict import LLGUIDANCE_SUPPORT, prepared_schema_text
from radixlm.runtime.grammar.verified import with_verifier
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.tool_calls import CALL_END, SEPARATOR, TRIGGER, ToolCallsSpec, call_begin

_MAX_VALIDATED = 8  # templates kept between validate and compile
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
    to the twin, whose masks ``fill_bitmask_loose`` gives; ``fill_bitmask`` stays exact.

    The twin is fed lazily: the tokens the exact matcher consumed since the twin last caught
    up wait in ``_twin_pending`` (a rollback takes them back from there first), and the twin
    consumes them at its next mask, which the step's prefetch computes on the worker thread
    while the model runs: the step thread pays one llguidance commit per token, not two."""

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
        self._twin_pending: list[int] = []  # consumed by the exact matcher, not yet by the twin
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
        self._sync_twin()
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
        """The twin is to take what the exact matcher took (at its next mask: ``_sync_twin``)."""
        self._plain_exact = False
        if self._twin is not None:
            self._twin_pending += ids

    def _sync_twin(self) -> None:
        """The twin consumes the pending tokens (a relaxation: it always can; if not, it is
        dropped and the masks are exact from here on)."""
        pending = self._twin_pending
        if pending:
            if self._twin is not None and self._twin.try_consume_tokens(pending) != len(pending):
                self._twin = None
            self._twin_pending = []

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
        pending = min(num_tokens, len(self._twin_pending))
        if pending:
            del self._twin_pending[len(self._twin_pending) - pending :]
        rest = num_tokens - pending
        if rest and self._twin is not None and not self._twin.rollback(rest):
            self._twin = None

    def fork(self) -> LLGuidanceMatcher:
        twin = self._twin.deep_copy() if self._twin is not None else None
        m = LLGuidanceMatcher(self.vocab, self._m.deep_copy(), self._accepted, self._terminated,
                              twin, self._table)  # fmt: skip
        m._twin_pending = list(self._twin_pending)
        return m

    def forced_bytes(self) -> bytes:
        if self._terminated:
            return b""
        forced = self._m.compute_ff_bytes()  # most states force nothing: then no more calls
        if not forced or self._accepting():
            return b""
        return bytes(forced)

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
