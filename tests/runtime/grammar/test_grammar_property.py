"""Property: every valid instance of a small schema, serialized compactly and tokenized, is
accepted token by token (each token allowed by the mask at its step), by both backends."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
from grammar_helpers import BACKENDS, walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.runtime.grammar.constraint import Constraint

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "nick": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
        "bio": {"type": "string"},
    },
    "required": ["name", "age"],
}
OPTIONAL = ("score", "tags", "active", "nick", "bio")

# Printable text: outlines' JSON strings exclude control characters (and U+007F..U+009F), and
# xgrammar's length-bounded strings exclude escapes (both over-strict, never invalid).
_TEXT = st.characters(
    exclude_categories=("Cc", "Cs"), exclude_characters='"\\', max_codepoint=0x2FFF
)
# Unbounded strings take escapes: quotes, backslashes, newlines, tabs.
_ESCAPED_TEXT = st.one_of(
    st.characters(exclude_categories=("Cc", "Cs"), max_codepoint=0x2FFF),
    st.sampled_from('"\\\n\t'),
)


@st.composite
def instances(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": draw(st.text(_TEXT, max_size=12)),
        "age": draw(st.integers(0, 150)),
    }
    values = {
        "score": st.floats(allow_nan=False, allow_infinity=False, width=32),
        "tags": st.lists(st.sampled_from(["red", "green", "blue"]), max_size=3),
        "active": st.booleans(),
        "nick": st.one_of(st.none(), st.text(_TEXT, max_size=5)),
        "bio": st.text(_ESCAPED_TEXT, max_size=20),
    }
    present = draw(st.lists(st.sampled_from(OPTIONAL), unique=True))
    for key in OPTIONAL:  # keys in schema order: the grammar generates them in that order
        if key in present:
            out[key] = draw(values[key])
    return out


def test_valid_instances_are_accepted(tokenizer: Any, compile_for: Callable[..., Any]) -> None:
    # outlines cannot enforce minimum / maximum: it gets the schema in best-effort mode.
    compiled = {
        b: compile_for(b, Constraint.from_params(json_schema=SCHEMA, best_effort=b == "outlines"))
        for b in BACKENDS
    }

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(instances())
    def check(instance: dict[str, Any]) -> None:
        jsonschema.validate(instance, SCHEMA)
        text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for backend in BACKENDS:
            walk(compiled[backend].new_matcher(), ids)

    check()
