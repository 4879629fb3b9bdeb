"""``patterns``: match decisions for property-name regexes, "matches every name", and the
complement regex of a finite name set (checked with Python's ``re`` and with llguidance's own
regex engine, which is what enforces it)."""

from __future__ import annotations

import re

import pytest
from grammar_helpers import BYTE_VOCAB, grammar_accepts
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.grammar import Constraint, get_backend
from radixlm.runtime.grammar.patterns import matches_every_name, names_except, regex_matches


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        (".*", "anything", True),
        ("^[a-z]+$", "basic", True),
        ("^[a-z]+$", "Basic", False),
        ("^x-", "x-rate", True),
        ("\\d", "a1", True),
        ("^\\w+$", "snake_case", True),
        ("é", "é", None),  # non-ASCII: not decided
        ("(?i)abc", "ABC", None),  # inline flags: not ECMA-262
        ("(?<n>a)\\k<n>", "aa", None),  # named group / backreference
        ("\\p{L}", "a", None),  # Unicode property escape
        ("^(?:a|b)$", "b", True),
        ("[", "a", None),  # not a regex
    ],
)
def test_regex_matches(pattern: str, name: str, expected: bool | None) -> None:
    assert regex_matches(pattern, name) is expected


@pytest.mark.parametrize(
    ("pattern", "every"),
    [
        (".*", True),
        ("", True),
        ("^[a-zA-Z0-9_]*", True),
        ("^([a-z])*", True),
        ("^[a-z]*$", False),  # anchored at the end
        (".+", False),
        ("\\b", False),
        ("a*\\b", False),
        ("[$]*", True),  # a literal $ in a class
        ("x?", True),
    ],
)
def test_matches_every_name(pattern: str, every: bool) -> None:
    assert matches_every_name(pattern) is every


NAMES = st.lists(st.text(alphabet="ab-]^\\.\n$", max_size=4), max_size=4)


@settings(max_examples=200, deadline=None)
@given(names=NAMES, probe=st.text(alphabet="ab-]^\\.\n$c", max_size=6))
def test_names_except_is_the_complement(names: list[str], probe: str) -> None:
    rx = names_except(names)
    assert (re.fullmatch(rx, probe) is not None) == (probe not in names)
    ecma = rx[:-1] + "\\Z"  # ECMA-262 `$` is the very end; Python's also before a last \n
    assert (re.search(ecma, probe) is not None) == (probe not in names)  # anchored: same


def test_names_except_in_llguidance() -> None:
    """The backend that enforces a rewritten pattern (llguidance) reads it the same way."""
    pytest.importorskip("llguidance")
    names = ["redirect", "red", "x.y", ""]
    schema = {
        "type": "object",
        "patternProperties": {names_except(names): {"type": "integer"}},
        "additionalProperties": {"type": "string"},
    }
    backend = get_backend("llguidance")(BYTE_VOCAB)
    compiled = backend.compile(Constraint.from_params(json_schema=schema))
    keys = [("redirect", False), ("redirects", True), ("red", False), ("re", True),
            ("x.y", False), ("xzy", True), ("", False), ("r\\n", True)]  # fmt: skip
    for key, integer in keys:
        assert grammar_accepts(compiled.new_matcher(), f'{{"{key}":1}}') is integer, key
        assert grammar_accepts(compiled.new_matcher(), f'{{"{key}":"s"}}') is not integer, key
