"""A JSON schema as text: its shape limits (checked iteratively, safe on hostile input) and its
canonical form (the compile-cache key). Torch-free and a leaf of the grammar package: the
constraint spec, the strictness check and tool calls all build on it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.schema_keywords import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES

# Deepest schema nesting the engine accepts (the server applies its stricter, configurable one).
SCHEMA_MAX_DEPTH = 128


def json_shape(value: Any) -> tuple[int, int]:
    """``(depth, nodes)`` of a parsed JSON value, computed iteratively (never by recursion, so
    a hostile 10,000-deep document cannot overflow the stack). A scalar has depth 0."""
    depth = nodes = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, d = stack.pop()
        nodes += 1
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        depth = max(depth, d + 1)
        stack.extend((c, d + 1) for c in children)
    return depth, nodes


def check_json_shape(value: Any, what: str, max_depth: int, max_nodes: int) -> None:
    """Raise ``GrammarError`` when ``value`` nests deeper than ``max_depth`` or has more than
    ``max_nodes`` values (iterative: safe on any input)."""
    depth, nodes = json_shape(value)
    if depth > max_depth:
        raise GrammarError(f"{what} nests {depth} levels deep; the limit is {max_depth}")
    if nodes > max_nodes:
        raise GrammarError(f"{what} has {nodes} values; the limit is {max_nodes}")


# The engine's own bound on a schema (the server applies its stricter, configurable one first).
MAX_SCHEMA_NODES = 100_000


def canonical_schema(schema: Any, depth: int = 0) -> Any:
    """The same schema with keyword keys sorted (a stable cache key). Order that means
    something is kept: property maps (the generated key order), lists, and data values
    (``enum``, ``const``, ``default``, ...)."""
    if not isinstance(schema, dict) or depth > SCHEMA_MAX_DEPTH:
        return schema
    out: dict[str, Any] = {}
    for key in sorted(schema):
        value = schema[key]
        if key in SCHEMA_MAPS and isinstance(value, dict):
            value = {k: canonical_schema(v, depth + 1) for k, v in value.items()}
        elif key in SCHEMA_VALUES:
            value = canonical_schema(value, depth + 1)
        elif key in (*SCHEMA_LISTS, "items") and isinstance(value, list):
            value = [canonical_schema(v, depth + 1) for v in value]
        elif key == "items":
            value = canonical_schema(value, depth + 1)
        elif key == "dependencies" and isinstance(value, dict):
            value = {k: canonical_schema(v, depth + 1) for k, v in value.items()}
        out[key] = value
    return out


def normalize_schema_text(schema: str | Mapping[str, Any] | bool) -> str:
    """Canonical JSON text of a schema given as JSON text, a mapping or a bool."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema: not valid JSON: {exc}") from exc
        except RecursionError:
            raise GrammarError(f"json_schema nests deeper than {SCHEMA_MAX_DEPTH} levels") from None
    # NOTE: iterative, before anything that recurses over the schema (json.dumps, metaschema).
    check_json_shape(schema, "json_schema", SCHEMA_MAX_DEPTH, MAX_SCHEMA_NODES)
    if not isinstance(schema, (Mapping, bool)):
        raise GrammarError(
            f"json_schema must be a JSON object (or a bool), got {type(schema).__name__}"
        )
    schema = dict(schema) if isinstance(schema, Mapping) else schema
    return json.dumps(canonical_schema(schema), separators=(",", ":"), ensure_ascii=False)
