"""JSON-schema keyword tables shared by the strictness check, the normalizer and the
disjointness prover (one place for them)."""

from __future__ import annotations

from typing import Any

_MAX_DEPTH = 64

# Keywords that make a JSON-schema validator reject instances.
VALIDATION_KEYWORDS = frozenset(
    {
        "type", "enum", "const",
        "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
        "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
        "dependencies", "unevaluatedProperties",
        "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
        "contains", "minContains", "maxContains", "unevaluatedItems",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
        "$ref", "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip
# Defined by draft 3 only: under a later draft, an annotation like any unknown format.
DRAFT3_ONLY_FORMATS = frozenset(
    {"color", "host-name", "ip-address", "utc-millisec", "phone", "style"}
)
# The ``format`` values that some JSON Schema draft (3 to 2020-12) defines. Validators assert
# these (with a format checker); any other value is an annotation that no validator checks.
SPEC_FORMATS = DRAFT3_ONLY_FORMATS | frozenset(
    {
        "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
        "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
        "uri-template", "json-pointer", "relative-json-pointer", "regex",
    }
)  # fmt: skip
# Where subschemas live: name -> how its value holds them (``items`` and ``dependencies`` take
# either a schema / list, or a map whose values may be schemas; handled where used).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_VALUES = (
    "additionalProperties", "propertyNames", "unevaluatedProperties", "additionalItems",
    "unevaluatedItems", "contains", "not", "if", "then", "else",
)  # fmt: skip
SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
# Keywords that say something about a schema but assert nothing about instances (``$schema``
# included: inside a schema without embedded resources it changes nothing).
ANNOTATIONS = frozenset({"$schema", "$comment", "title", "description", "default", "examples",
                         "deprecated", "readOnly", "writeOnly"})  # fmt: skip
# Keys that assert nothing about an instance at all: annotations and where subschemas are
# kept for reference (a schema's own ``$defs`` / ``$id`` / ``$anchor``).
NON_ASSERTING = ANNOTATIONS | {"$id", "$defs", "definitions", "$anchor"}


def is_number(v: Any) -> bool:
    """A JSON number (``true`` / ``false`` are not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def resolve_pointer(root: object, ref: object) -> object | None:
    """The target of a local JSON-pointer reference (``"#"``, ``"#/$defs/x"``), or None."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def map_subschemas(s: dict[str, Any], fn: Any) -> dict[str, Any]:
    """A copy of schema object ``s`` with ``fn`` applied to each direct subschema (data values
    such as ``enum`` / ``const`` / ``default`` are left alone)."""
    out = dict(s)
    for key in SCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            out[key] = {k: fn(v) for k, v in s[key].items()}
    for key in SCHEMA_VALUES:
        if key in s:
            out[key] = fn(s[key])
    for key in SCHEMA_LISTS:
        if isinstance(s.get(key), list):
            out[key] = [fn(v) for v in s[key]]
    if isinstance(s.get("items"), list):
        out["items"] = [fn(v) for v in s["items"]]
    elif "items" in s:
        out["items"] = fn(s["items"])
    if isinstance(s.get("dependencies"), dict):
        out["dependencies"] = {
            k: fn(v) if isinstance(v, dict) else v for k, v in s["dependencies"].items()
        }
    return out


def strip_annotations(s: Any, depth: int = 0) -> Any:
    """``s`` without annotation keywords (titles, descriptions, defaults, ...) at any schema
    level: two schemas equal after this accept the same instances."""
    if not isinstance(s, dict) or depth > _MAX_DEPTH:
        return s
    out = map_subschemas(s, lambda v: strip_annotations(v, depth + 1))
    return {k: v for k, v in out.items() if k not in ANNOTATIONS}


class Draft:
    """The schema's draft: its keywords and validator class, and the root (for ``$ref``)."""

    def __init__(self, root: Any) -> None:
        import jsonschema

        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        self.keywords = frozenset(cls.VALIDATORS)
        self.cls = cls
        self.root = root
        self.validator = cls(root)
        self.ref_alone = "prefixItems" not in self.keywords  # before 2019-09: $ref hides siblings
