"""JSON-schema keyword tables shared by the strictness check, the normalizer and the
disjointness prover (one place for them)."""

from __future__ import annotations

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
# The ``format`` values that some JSON Schema draft (3 to 2020-12) defines. Validators assert
# these (with a format checker); any other value is an annotation that no validator checks.
SPEC_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
        "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
        "uri-template", "json-pointer", "relative-json-pointer", "regex",
        "color", "host-name", "ip-address", "utc-millisec", "phone", "style",
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
