"""``patterns``: match decisions for property-name regexes, "matches every name", and the
complement regex of a finite name set (checked with Python's ``re`` and with llguidance's own
regex engine, which is what enforces it)."""

from __future__ import annotations

import re

import pytest
from grammar_helpers import BYTE_VOCAB, grammar_accepts
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.grammar.base import get_backend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.patterns import (
    can_match_backslash,
    matches_every_name,
    names_except,
    pattern_complement,
    regex_matches,
    without_lookarounds,
)
from radixlm.runtime.grammar.relax import VERIFY_KEY, relax_schema


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


COMPLEMENTED = ["^[a-c]+$", "^[a-c]*$", "[ab]", "\\s", "^[\\.\\,\\*\\\\\\-\\s\\{\\}\\(\\)]+$",
                "^[-a]+$", "^\\s*$"]  # fmt: skip
NOT_COMPLEMENTED = ["^a+$", "\\d", "^[\\w]+$", "^[^a]+$", "[]", "^[a]]+$", "^[a-c]+", "(?i)[a]"]
PROBES = st.text(alphabet="abcxyz.,*\\-{}()[] \t\n\u00a0\u2003\u3000\ufeff\x1c", max_size=5)


@settings(max_examples=300, deadline=None)
@given(probe=PROBES)
def test_pattern_complement_is_exact_for_python_re(probe: str) -> None:
    """Never admits a string the pattern matches under Python's reading (the one
    ``jsonschema`` validates with), white space included; exact but for strings with U+FEFF
    (white space to ECMA-262 only) or a newline (Python's ``$`` matches before a final one).
    The backends read ``$`` as ECMA-262 does (the very end)."""
    for pattern in COMPLEMENTED:
        other = pattern_complement(pattern)
        assert other is not None, pattern
        admitted = re.search(other[:-1] + "\\Z", probe) is not None
        if admitted:
            assert re.search(pattern, probe) is None, (pattern, probe)
        elif "\ufeff" not in probe and "\n" not in probe:
            assert re.search(pattern, probe) is not None, (pattern, probe)


@pytest.mark.parametrize("pattern", NOT_COMPLEMENTED)
def test_pattern_complement_refuses_other_forms(pattern: str) -> None:
    assert pattern_complement(pattern) is None


@pytest.mark.parametrize("backend_name", ["llguidance", "xgrammar", "outlines"])
def test_pattern_complement_in_backends(backend_name: str) -> None:
    """The backends compile the complements and read them as Python does on these strings
    (as a regex constraint: a full match, so without the anchors)."""
    backend = get_backend(backend_name)(BYTE_VOCAB)
    probes = ["", "ab", "a b", "a\u00a0", "x", " ", "\u3000", "{}", "a-"]
    for pattern in COMPLEMENTED:
        other = pattern_complement(pattern)
        assert other is not None
        compiled = backend.compile(Constraint.from_params(regex=other[1:-1]))
        for probe in probes:
            expected = re.search(pattern, probe) is None
            assert grammar_accepts(compiled.new_matcher(), probe) is expected, (pattern, probe)


@pytest.mark.parametrize(
    ("pattern", "can"),
    [("^a.*$", True), ("^[a-z]+$", False), ("^[ -~]+$", True), ("^[^a]+$", True),
     ("^\\S+$", True), ("[\\\\]", True), ("^\\d+$", False), ("^[\\w-]+$", False),
     ("^x\\.y$", False), ("^(a|b)+$", False), ("^[]a]$", False)],
)  # fmt: skip
def test_can_match_backslash(pattern: str, can: bool) -> None:
    assert can_match_backslash(pattern) is can


def test_patterns_on_escaped_text_are_refused_where_unsound() -> None:
    """outlines matches a ``pattern`` against the string's JSON text: under ``^a.*$`` it took
    "a\\nb" (its text a, \\, n, b), which ``jsonschema`` rejects. Such patterns are refused
    there; the other backends enforce them."""
    schema = {"type": "string", "pattern": "^a.*$"}
    c = Constraint.from_params(json_schema=schema)
    with pytest.raises(GrammarError, match="escaped JSON text"):
        get_backend("outlines")(BYTE_VOCAB).validate(c)
    for name in ("llguidance", "xgrammar"):
        compiled = get_backend(name)(BYTE_VOCAB).compile(c)
        assert grammar_accepts(compiled.new_matcher(), '"ab"')
        assert not grammar_accepts(compiled.new_matcher(), '"a\\nb"'), name
    safe = Constraint.from_params(json_schema={"type": "string", "pattern": "^[a-z]+$"})
    get_backend("outlines")(BYTE_VOCAB).validate(safe)


@pytest.mark.parametrize(
    ("pattern", "looser"),
    [
        (r"^(?!test)[a-z]{3,8}$", r"^[a-z]{3,8}$"),
        (r"(?<!a)b", "b"),
        (r"[(?!]x(?=y)", "[(?!]x"),  # a class holding "(?!" is no group
        (r"^(?!(ab)+$)[a-c]*$", r"^[a-c]*$"),  # groups inside the lookaround go with it
        (r"^[a-z]+(?<!-)$", r"^[a-z]+$"),
        (r"^(?=.*\d).{8,}$", None),  # "." can match a backslash
        (r"(a)(?!\1)b", None),  # a back-reference
        (r"(?!a)|b", None),  # a top-level |
        (r"^(?=[^a])[^b]+$", None),  # a negated class
        (r"^(?!x)[a-z]{2,65}$", None),  # a count over 64
    ],
)
def test_without_lookarounds(pattern: str, looser: str | None) -> None:
    assert without_lookarounds(pattern) == looser


LOOKAROUND_PATTERNS = [r"^(?!test)[a-z]{3,8}$", r"(?<!a)b", r"^(?!(ab)+$)[a-c]*$",
                       r"^[a-z]+(?<!c)$", r"^a(?=b)", r"x(?!y)z?"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(LOOKAROUND_PATTERNS), st.text(alphabet="abcdestxyz-", max_size=10))
def test_without_lookarounds_matches_a_superset(pattern: str, text: str) -> None:
    """Every string the pattern matches (searched, as JSON Schema does), the looser one does."""
    looser = without_lookarounds(pattern)
    assert looser is not None
    if re.search(pattern, text):
        assert re.search(looser, text)


def test_a_lookaround_pattern_leaves_the_grammar_its_plain_part() -> None:
    """The grammar keeps ``pattern`` without its lookarounds where that is plain (a tighter
    relaxation: the verifier then refuses only what the lookarounds refuse); otherwise it has
    none; either way the verifier checks the whole pattern."""
    schema = {"type": "string", "pattern": r"^(?!test)[a-z]{3,8}$"}
    relaxed = relax_schema(schema)
    assert relaxed.grammar["pattern"] == r"^[a-z]{3,8}$"
    assert relaxed.verify[VERIFY_KEY] == ["pattern"]
    assert relaxed.verify["pattern"] == schema["pattern"]
    wide = relax_schema({"type": "string", "pattern": r"^(?=.*\d).{8,}$"})
    assert "pattern" not in wide.grammar and wide.verify[VERIFY_KEY] == ["pattern"]
    m = (
        get_backend("xgrammar")(BYTE_VOCAB)
        .compile(Constraint.from_params(json_schema=schema))
        .new_matcher()
    )
    assert grammar_accepts(m.fork(), '"tesa"')
    assert not grammar_accepts(m.fork(), '"testing"')  # the verifier: the lookahead
    assert not grammar_accepts(m.fork(), '"ab1"')  # the grammar: [a-z]
