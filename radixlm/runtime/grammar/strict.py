"""JSON-schema strictness: refuse what a backend would silently not enforce.

A validation keyword that a backend ignores makes it generate JSON that the caller's own
validator rejects (``uniqueItems``, ``multipleOf`` on numbers, ``if``/``then``/``else``, ...).
``check_schema`` walks every subschema and, unless the caller opted into best effort, raises a
``GrammarError`` that lists each such keyword with its location. Annotations (``title``,
``description``, ``default``, ...) and unknown keywords constrain nothing and pass.

Over-strict behaviour is accepted silently: the output still validates. Both backends forbid
properties that the schema does not declare unless it says ``additionalProperties`` (like
OpenAI's strict mode) and match ``pattern`` against the whole string; outlines never emits
``\\u`` escapes, xgrammar no escapes at all in length-bounded
strings. Silent under-enforcement found by probing (and rejected here): type-specific keywords
in a schema without ``"type"``, ``required`` names that ``properties`` does not declare, and
the per-backend gaps listed in the support tables at the bottom.

Both backends generate ``oneOf`` as ``anyOf``, which lets a value match two branches (invalid
under ``oneOf``): strict mode accepts a ``oneOf`` only when ``disjoint.one_of_disjoint`` proves
its branches pairwise disjoint.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.grammar.disjoint import one_of_disjoint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.normalize import lower_for_backends, normalize_schema
from radixlm.runtime.grammar.patterns import (
    can_match_backslash,
    is_lookaround_at,
    negation_problems,
    regex_matches,
    regex_syntax_positions,
)
from radixlm.runtime.grammar.relax import VERIFY_KEY, Relaxed, relax_schema
from radixlm.runtime.grammar.schema_keywords import (
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_VALUES,
    VALIDATION_KEYWORDS,
)
from radixlm.runtime.grammar.schema_text import (
    MAX_SCHEMA_NODES,
    SCHEMA_MAX_DEPTH,
    check_json_shape,
)

_SCHEMA_MAPS, _SCHEMA_VALUES, _SCHEMA_LISTS = SCHEMA_MAPS, SCHEMA_VALUES, SCHEMA_LISTS
# Type-specific keywords that the backends apply only when the schema states its "type".
_NEEDS_TYPE = frozenset(
    {
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minItems", "maxItems", "prefixItems", "items", "unevaluatedItems",
        "minProperties", "maxProperties", "patternProperties", "propertyNames",
        "unevaluatedProperties",
    }
)  # fmt: skip
# Keywords that evaluate properties / items in place: ``unevaluated*`` next to them depends on
# annotations, which the backends do not track.
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
             "dependentSchemas", "dependencies")  # fmt: skip
_MAX_DEPTH = SCHEMA_MAX_DEPTH
# Keywords the backends apply while ignoring every other validation keyword beside them (but
# those listed); measured on both backends. The normalizer distributes / filters most away.
_ALONE: dict[str, frozenset[str]] = {
    "$ref": frozenset({"$ref"}),
    "anyOf": frozenset({"anyOf"}),
    "oneOf": frozenset({"oneOf"}),
    "allOf": frozenset({"allOf"}),
    "enum": frozenset({"enum", "const"}),
    "const": frozenset({"enum", "const"}),
}


@dataclass(frozen=True)
class SchemaSupport:
    """What one backend enforces. ``multiple_of_integers_only``: ``multipleOf`` is enforced
    only on ``{"type": "integer"}`` schemas; ``max_all_of``: longest ``allOf`` it merges.

    Every backend generates only declared properties, so a ``required`` name missing from
    ``properties`` is never produced: that is reported for all backends."""

    keywords: frozenset[str]
    formats: frozenset[str]
    multiple_of_integers_only: bool = False
    max_all_of: int = 1
    # ``{}`` (any value) below the root compiles correctly.
    empty_subschema: bool = True
    # A ``pattern`` with a top-level ``|`` compiles correctly.
    pattern_alternation: bool = True
    # (keyword, sibling): the keyword is ignored when the sibling is in the same schema.
    ignored_with: tuple[tuple[str, str], ...] = ()
    # Keywords applied while every other validation keyword beside them (but those listed) is
    # ignored; None: the measured xgrammar / outlines table ``_ALONE``.
    alone: dict[str, frozenset[str]] | None = None
    # Type-specific keywords (``_NEEDS_TYPE``) are applied only when the schema states "type".
    needs_type: bool = True
    # Only declared properties are generated (absent ``additionalProperties`` acts as
    # ``false``): ``required`` names that ``properties`` does not declare never are, and
    # ``false`` property schemas can be dropped (``lower_for_backends``).
    declared_properties_only: bool = True
    # ``pattern`` / ``patternProperties`` are searched, as JSON Schema says (not full-matched),
    # and a property name is checked against every pattern and ``properties`` entry it matches.
    pattern_search: bool = False
    # ``pattern`` is matched against the JSON text of the string, escapes included (outlines):
    # a pattern that can match a backslash can then accept a string it refuses ("a\\nb" under
    # ``^a.*$``), so such patterns are refused.
    pattern_on_escaped_text: bool = False
    # Negated classes are exact only for ASCII exclusions (xgrammar; patterns.negation_problems).
    negated_class_ascii_only: bool = False

    @property
    def names_as_patterns(self) -> bool:
        """A map's name pattern may reach the backend as ``patternProperties`` (``relax``)."""
        return "patternProperties" in self.keywords


@dataclass(frozen=True)
class Unsupported:
    keyword: str  # e.g. "uniqueItems" or "format: 'ipv4'"
    path: str  # JSON pointer of the subschema, "#" for the root


def _children(schema: dict[str, Any]) -> list[tuple[str, Any]]:
    """(relative path, subschema) pairs of one schema object."""
    out: list[tuple[str, Any]] = []
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            out.extend((f"{key}/{_escape(k)}", v) for k, v in value.items())
    for key in _SCHEMA_VALUES:
        if key in schema:
            out.append((key, schema[key]))
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            out.extend((f"{key}/{i}", v) for i, v in enumerate(value))
    items = schema.get("items")
    if isinstance(items, list):
        out.extend((f"items/{i}", v) for i, v in enumerate(items))
    elif items is not None:
        out.append(("items", items))
    deps = schema.get("dependencies")
    if isinstance(deps, dict):
        out.extend(
            (f"dependencies/{_escape(k)}", v) for k, v in deps.items() if isinstance(v, dict)
        )
    return out


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _problems(schema: dict[str, Any], support: SchemaSupport, typed: bool) -> list[str]:
    """Unsupported keywords of one schema object (not of its subschemas). ``typed``: the
    instance type is implied by the position (``propertyNames`` applies to keys: strings)."""
    found = []
    typed = typed or "type" in schema
    alone = _ALONE if support.alone is None else support.alone
    for key, value in schema.items():
        if key not in VALIDATION_KEYWORDS:
            continue
        if key not in support.keywords:
            if not (key == "uniqueItems" and value is False):
                found.append(key)
            continue
        if key in _NEEDS_TYPE and not typed and support.needs_type:
            found.append(f'{key} (without "type")')
        found.extend(
            f"{key} (with {other})"
            for k, other in support.ignored_with
            if k == key and other in schema
        )
        if key == "format" and value not in support.formats:
            found.append(f"format: {value!r}")
        elif key == "multipleOf" and support.multiple_of_integers_only:
            if schema.get("type") != "integer":
                found.append("multipleOf (on a non-integer schema)")
            elif not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
                found.append("multipleOf (not an integer)")
        elif key == "pattern" and isinstance(value, str):
            found.extend(f"pattern: {value!r} ({p})" for p in pattern_problems(value, support))
        elif key == "allOf" and isinstance(value, list) and len(value) > support.max_all_of:
            found.append(f"allOf (with {len(value)} subschemas)")
        elif key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            found.append(f"$ref: {value!r} (external reference)")
        elif key == "$ref" and isinstance(value, str) and value != "#" and value[:2] != "#/":
            found.append(f"$ref: {value!r} (anchor reference)")
        elif key in alone and any(k in VALIDATION_KEYWORDS and k not in alone[key]
                                  for k in schema):  # fmt: skip
            found.append(f"{key} (with sibling keywords)")
        elif key.startswith("unevaluated") and any(k in schema for k in _IN_PLACE):
            found.append(f"{key} (with in-place applicators)")
        elif key == "patternProperties" and isinstance(value, dict) and not support.pattern_search:
            found.extend(_pattern_properties_problems(schema, value))
        elif key == "items" and isinstance(value, list):
            found.append("items (array form; use prefixItems)")
        elif key == "required" and isinstance(value, list) and support.declared_properties_only:
            declared = schema.get("properties")
            declared = declared if isinstance(declared, dict) else {}
            found.extend(
                f"required: {name!r} (not in properties)" for name in value if name not in declared
            )
    return found


def _regex_features(pattern: str) -> set[str]:
    """Which of "lookaround", "inner anchor", "top-level |" a regex uses (escapes and
    character classes skipped)."""
    found: set[str] = set()
    depth, n = 0, len(pattern)
    for i in regex_syntax_positions(pattern):
        ch = pattern[i]
        if ch == "(":
            if is_lookaround_at(pattern, i):
                found.add("lookaround")
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            found.add("top-level |")
        elif ch == "^" and i != 0:
            found.add("inner anchor")
        elif ch == "$" and i != n - 1:
            found.add("inner anchor")
    return found


def pattern_problems(pattern: str, support: SchemaSupport) -> list[str]:
    """Why a backend cannot enforce ``pattern`` exactly (both ignore lookarounds and anchors
    inside the pattern; outlines splices the pattern into its regex without a group)."""
    found = _regex_features(pattern) - ({"top-level |"} if support.pattern_alternation else set())
    if support.pattern_search:  # anchors mean what they say in a search
        found.discard("inner anchor")
    out = sorted(f"{f} unsupported" for f in found)
    if support.pattern_on_escaped_text and can_match_backslash(pattern):
        out.append("matched on escaped JSON text, and can match a backslash")
    return out + negation_problems(pattern, support.negated_class_ascii_only)


def _anchored(pattern: str) -> bool:
    return pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")


def _pattern_properties_problems(schema: dict[str, Any], patterns: dict[str, Any]) -> list[str]:
    """The backends match a ``patternProperties`` key against the whole name and apply one
    schema per key; JSON Schema searches and applies every matching one (and ``properties``)."""
    found = [
        f"patternProperties: {p!r} (not anchored with ^...$)" for p in patterns if not _anchored(p)
    ]
    found += [
        f"patternProperties: {p!r} ({f} unsupported)"
        for p in patterns
        for f in sorted(_regex_features(p) - {"top-level |"})
    ]
    declared = schema.get("properties")
    names = list(declared) if isinstance(declared, dict) else []
    for p in patterns:
        if any(regex_matches(p, n) is not False for n in names):  # undecided: may match
            found.append(f"patternProperties: {p!r} (matches a declared property)")
    if len(patterns) > 1:
        found.append("patternProperties (more than one pattern)")
    return found


def find_unsupported(schema: Any, support: SchemaSupport) -> list[Unsupported]:
    """Every keyword of ``schema`` (at any depth) that ``support`` does not enforce."""
    out: list[Unsupported] = []
    stack: list[tuple[str, Any, int, bool]] = [("#", schema, 0, False)]
    while stack:
        path, node, depth, typed = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > _MAX_DEPTH:
            raise GrammarError(f"JSON schema nests deeper than {_MAX_DEPTH} levels")
        out.extend(Unsupported(k, path) for k in _problems(node, support, typed))
        if not support.empty_subschema and path != "#" and not VALIDATION_KEYWORDS & node.keys():
            out.append(Unsupported("{} (a subschema allowing any value)", path))
        if "oneOf" in support.keywords and not one_of_disjoint(schema, node):
            out.append(Unsupported("oneOf (branches not provably disjoint)", path))
        for rel, sub in reversed(_children(node)):
            stack.append((f"{path}/{rel}", sub, depth + 1, rel == "propertyNames"))
    return out


def check_metaschema(schema: Any) -> None:
    """Raise ``GrammarError`` unless ``schema`` is valid against its (declared or 2020-12)
    metaschema."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"invalid JSON schema: must be an object, got {type(schema).__name__}")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except RecursionError:
        raise GrammarError("invalid JSON schema: nested too deeply to check") from None
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarError(f"invalid JSON schema at #/{where}: {exc.message}") from None


DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


@functools.lru_cache(maxsize=512)
def _metaschema_checked(spec: str) -> None:
    """``check_metaschema`` of schema text, remembered when it passes (validation at request
    time and the compile after it check the same text; big schemas take ~100 ms)."""
    check_metaschema(json.loads(spec))


def prepared_schema_text(spec: str, lower: bool = True, names_as_patterns: bool = True) -> str:
    """What the backends compile for schema text ``spec``: ``normalize.normalize_schema`` (exact
    rewrites), ``relax.relax_schema`` (the keywords the verifier checks, relaxed), then
    (``lower``: for backends that generate declared properties only)
    ``normalize.lower_for_backends``, as compact JSON (key order kept). The result is written
    in 2020-12 keywords (``prefixItems``, numeric exclusive bounds, ...) and says so in its
    ``$schema`` (llguidance reads keywords by the declared draft). Remembered per
    ``(spec, lower)``: validation and compilation of one request prepare the same text."""
    # NOTE: positional, so that both calls share keys
    return _prepared_schema_text(spec, lower, names_as_patterns)


@functools.lru_cache(maxsize=512)
def _relaxed(spec: str, names_as_patterns: bool = True) -> Relaxed:
    """``normalize.normalize_schema`` of schema text, in 2020-12 keywords, split by
    ``relax.relax_schema`` into the grammar's relaxation and the verifier's exact schema."""
    schema = normalize_schema(json.loads(spec))
    if isinstance(schema, dict) and "$schema" in schema:
        schema = {**schema, "$schema": DRAFT_2020_12}
    return relax_schema(schema, names_as_patterns)


def verified_keywords(spec: str, names_as_patterns: bool = True) -> list[str]:
    """The keywords of schema text ``spec`` that the verifier, not the grammar, enforces."""
    found: set[str] = set()
    stack = [_relaxed(spec, names_as_patterns).verify]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.update(node.get(VERIFY_KEY, ()))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return sorted(found)


def verifier_schema_text(spec: str, names_as_patterns: bool = True) -> str | None:
    """The exact, marked schema the verifier checks generated values against (``relax``), or
    None when the grammar alone enforces schema text ``spec``."""
    verify = _relaxed(spec, names_as_patterns).verify
    return None if verify is None else json.dumps(verify, ensure_ascii=False)


@functools.lru_cache(maxsize=512)
def _prepared_schema_text(spec: str, lower: bool, names_as_patterns: bool) -> str:
    schema = _relaxed(spec, names_as_patterns).grammar
    if lower:
        schema = lower_for_backends(schema)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def check_schema(spec: str, support: SchemaSupport, backend: str, *, best_effort: bool) -> Any:
    """Parse, metaschema-check, normalize and strictness-check schema text; return the
    prepared schema (what the backend compiles)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"json_schema: not valid JSON: {exc}") from None
    if schema is False:
        raise GrammarError("invalid JSON schema: `false` matches nothing")
    # NOTE: before the metaschema check, which recurses (a deep schema would overflow it).
    check_json_shape(schema, "JSON schema", _MAX_DEPTH, MAX_SCHEMA_NODES)
    _metaschema_checked(spec)
    names = support.names_as_patterns
    schema = json.loads(prepared_schema_text(spec, support.declared_properties_only, names))
    if schema is False:
        raise GrammarError("JSON schema matches nothing (after merging its subschemas)")
    if best_effort:
        return schema
    bad = find_unsupported(schema, support)
    if bad:
        listed = ", ".join(f"{u.keyword} (at {u.path})" for u in bad)
        raise GrammarError(
            f"JSON schema uses keywords that the {backend} grammar backend cannot enforce: "
            f"{listed}. Remove them, or request best-effort decoding to ignore them."
        )
    return schema


_COMMON = frozenset(
    {
        "type", "enum", "const", "properties", "required", "additionalProperties",
        "minProperties", "unevaluatedProperties", "items", "prefixItems", "minItems",
        "maxItems", "unevaluatedItems", "minLength", "maxLength", "pattern", "format",
        "anyOf", "oneOf", "allOf", "$ref",
    }
)  # fmt: skip

_XGRAMMAR_EXTRA = frozenset(
    {
        "patternProperties", "propertyNames", "maxProperties", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
# Native formats that reject every invalid instance of the suite's optional format tests
# (tests/runtime/grammar/test_grammar_formats.py). Dropped as inexact: xgrammar's date /
# date-time (no days per month), time (any leap second), hostname, ipv6; outlines' date, time,
# uri; llguidance's date, date-time, time, hostname. ``format``s with an exact regex in
# ``formats.FORMAT_PATTERNS`` are rewritten to ``pattern`` by the normalizer before these apply
# (unless a ``pattern`` is beside them).
_XGRAMMAR_FORMATS = frozenset(
    {
        "email", "duration", "uuid", "uri", "uri-reference", "uri-template", "ipv4",
        "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip

# Measured with xgrammar 0.2.8 (tests/runtime/grammar/test_grammar_strict.py keeps it honest).
XGRAMMAR_SUPPORT = SchemaSupport(
    keywords=_COMMON | _XGRAMMAR_EXTRA,
    formats=_XGRAMMAR_FORMATS,
    multiple_of_integers_only=True,
    negated_class_ascii_only=True,  # measured: [^é] admits \u00e9, \S admits U+00A0
    # Found in xgrammar's warnings: it drops length bounds next to pattern / format, and
    # multipleOf next to a numeric range; measured: it drops pattern next to format.
    ignored_with=(
        ("pattern", "format"),
        ("minLength", "pattern"),
        ("maxLength", "pattern"),
        ("minLength", "format"),
        ("maxLength", "format"),
        ("multipleOf", "minimum"),
        ("multipleOf", "maximum"),
        ("multipleOf", "exclusiveMinimum"),
        ("multipleOf", "exclusiveMaximum"),
    ),  # fmt: skip
)
# Measured with outlines-core 0.2.14: no numeric bounds, no min/maxProperties, no
# propertyNames / patternProperties, no minItems next to prefixItems; a ``{}`` subschema
# becomes an ungrouped alternation that leaks out of its position in the regex.
OUTLINES_SUPPORT = SchemaSupport(
    keywords=_COMMON - {"minProperties"},
    formats=frozenset({"email", "date-time", "uuid"}),
    # It drops pattern / format next to length bounds, and cannot compile pattern with format.
    ignored_with=(
        ("pattern", "format"),
        ("minItems", "prefixItems"),
        ("pattern", "minLength"),
        ("pattern", "maxLength"),
        ("format", "minLength"),
        ("format", "maxLength"),
    ),  # fmt: skip
    empty_subschema=False,
    pattern_alternation=False,
    pattern_on_escaped_text=True,
)

# Measured with llguidance 1.9 (it refuses by itself what it does not implement: ``not``,
# ``if`` / ``then`` / ``else``, ``contains``, ``uniqueItems``, ``propertyNames``, the
# ``dependent*`` keywords, ``unevaluated*``; the normalizer rewrites most of those first). It
# intersects sibling keywords, applies type-specific keywords without "type" and searches
# patterns. It is given the same "declared properties only" schema as the others.
LLGUIDANCE_SUPPORT = SchemaSupport(
    keywords=_COMMON | (_XGRAMMAR_EXTRA - {"propertyNames"}) | {"maxProperties"},
    formats=frozenset(
        {
            "duration",
            "email",
            "uri",
            "uuid",
            "ipv4",
            "ipv6",
        }
    ),  # fmt: skip
    max_all_of=1_000,
    alone={},
    needs_type=False,
    pattern_search=True,
)
