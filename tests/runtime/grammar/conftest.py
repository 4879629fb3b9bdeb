"""Fixtures for the grammar tests: the real SmolLM2 tokenizer (vocab 49152, EOS 2), its byte
vocabulary, and one instance of each backend. No model weights are loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from grammar_helpers import BACKENDS, EOS, VOCAB_SIZE

from radixlm.runtime.grammar.base import CompiledGrammar, GrammarBackend, get_backend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.runtime.models.loader import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def vocab(tokenizer: Any) -> TokenVocab:
    return TokenVocab.from_tokenizer(tokenizer, VOCAB_SIZE, [EOS])


@pytest.fixture(scope="session")
def backends(vocab: TokenVocab) -> dict[str, GrammarBackend]:
    return {name: get_backend(name)(vocab) for name in BACKENDS}


_COMPILED: dict[tuple[str, Constraint], CompiledGrammar] = {}


@pytest.fixture(scope="session")
def compile_for(backends: dict[str, GrammarBackend]) -> Callable[[str, Constraint], Any]:
    """compile_for(backend_name, constraint), memoized across the session."""

    def compile_(name: str, constraint: Constraint) -> CompiledGrammar:
        key = (name, constraint)
        if key not in _COMPILED:
            _COMPILED[key] = backends[name].compile(constraint)
        return _COMPILED[key]

    return compile_
