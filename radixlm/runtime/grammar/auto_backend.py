"""The ``auto`` backend: per constraint, the first installed backend that can enforce all of it.

Order (``AUTO_ORDER``), fastest first for what a request waits on:

1. ``llguidance``: compiles in milliseconds for most schemas (~1.5 s for the largest seen;
   masks are computed lazily, tens to hundreds of microseconds each), and enforces the most
   JSON Schema.
2. ``xgrammar``: the only one with EBNF and structural tags; precomputes masks (fast per step,
   seconds to compile a large schema).
3. ``outlines``: regular languages only; a last resort.

A backend "can enforce" a constraint when its ``validate`` passes (strict mode: no keyword it
would ignore). If the chosen backend still fails to compile, the next one that validates is
tried. A refusal by all names every backend's reason. Each compiled grammar records the backend
that made it (``CompiledGrammar.backend``); matchers of different backends share the bitmask
layout, so one batch can mix them.
"""

from __future__ import annotations

from radixlm.runtime.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    get_backend,
    register_backend,
)
from radixlm.runtime.grammar.constraint import CONSTRAINT_KINDS, Constraint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.vocab import TokenVocab

AUTO_ORDER = ("llguidance", "xgrammar", "outlines")


@register_backend
class AutoBackend(GrammarBackend):
    name = "auto"
    kinds = frozenset(CONSTRAINT_KINDS)

    def __init__(self, vocab: TokenVocab, order: tuple[str, ...] = AUTO_ORDER) -> None:
        super().__init__(vocab)
        self.backends: list[GrammarBackend] = []
        for name in order:
            try:
                self.backends.append(get_backend(name)(vocab))
            except ImportError:  # an optional grammar library is not installed
                continue
        if not self.backends:
            raise ImportError(f"none of the grammar backends {list(order)} is installed")

    def choose(self, constraint: Constraint) -> GrammarBackend:
        """The first backend whose ``validate`` passes; raises ``GrammarError`` naming each
        backend's reason when none does."""
        reasons: list[str] = []
        for backend in self.backends:
            try:
                backend.validate(constraint)
            except GrammarError as exc:
                reasons.append(f"{backend.name}: {exc}")
            else:
                return backend
        raise GrammarError(_refusal(constraint, reasons))

    def validate(self, constraint: Constraint) -> None:
        self.choose(constraint)

    def check_semantics(self, constraint: Constraint) -> None:
        self.choose(constraint)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        reasons: list[str] = []
        for backend in self.backends:
            try:
                return backend.compile(constraint)  # it checks the constraint first
            except GrammarError as exc:
                reasons.append(f"{backend.name}: {exc}")
        raise GrammarError(_refusal(constraint, reasons))


def _refusal(constraint: Constraint, reasons: list[str]) -> str:
    if len(reasons) == 1:
        return reasons[0]
    listed = " | ".join(reasons)
    return f"no grammar backend can serve this {constraint.kind} constraint: {listed}"
