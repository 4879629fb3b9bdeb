"""Structured generation: constraints, grammar backends, bitmasks, jump-forward.

Public API (the README's "Structured output" section is the user-facing description)::

    manager = GrammarManager(tokenizer, vocab_size, eos_token_ids, backend="xgrammar")
    constraint = Constraint.from_params(json_schema=schema)      # None when unconstrained
    manager.validate(constraint)                                 # cheap; GrammarError -> 400
    future = manager.submit(constraint)                          # Future[CompiledGrammar]
    matcher = manager.new_matcher(future.result())               # one per sequence
    bitmask = manager.allocate_bitmask(max_batch)                # CPU int32 [B, ceil(V/32)]
    matcher.fill_bitmask(bitmask, row)                           # per constrained row
    apply_token_bitmask(logits, bitmask, rows)                   # one batched call
    matcher.accept_token(token)                                  # after sampling
    jf = manager.jump_forward(matcher, [token], max_tokens=...)  # forced continuation

Backends are chosen by name from a registry (``get_backend``); each lives in one module.
"""

from __future__ import annotations

from radixlm.runtime.grammar.base import (
    CONSTRAINT_KINDS,
    MAX_JSON_WHITESPACE,
    CompiledGrammar,
    Constraint,
    ConstraintKind,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarTimeoutError,
    Whitespace,
    backend_names,
    get_backend,
    register_backend,
)
from radixlm.runtime.grammar.bitmask import (
    allocate_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    bitmask_to_bool,
    bitmask_width,
    fill_bitmask_tokens,
    is_token_allowed,
    reset_bitmask,
    set_bitmask_bits,
)
from radixlm.runtime.grammar.jump_forward import JumpForward, jump_forward
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.grammar.vocab import TokenVocab

__all__ = [
    "CONSTRAINT_KINDS",
    "MAX_JSON_WHITESPACE",
    "CompiledGrammar",
    "Constraint",
    "ConstraintKind",
    "GrammarBackend",
    "GrammarError",
    "GrammarManager",
    "GrammarMatcher",
    "GrammarTimeoutError",
    "JumpForward",
    "TokenVocab",
    "Whitespace",
    "allocate_bitmask",
    "apply_token_bitmask",
    "apply_token_bitmask_torch",
    "backend_names",
    "bitmask_to_bool",
    "bitmask_width",
    "fill_bitmask_tokens",
    "get_backend",
    "is_token_allowed",
    "jump_forward",
    "register_backend",
    "reset_bitmask",
    "set_bitmask_bits",
]
