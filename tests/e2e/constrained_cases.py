"""The constraint set of the e2e grammar tests: JSON schemas (every string and array bounded: a
135M model repeats itself until max_new_tokens otherwise), regexes, an EBNF grammar, choices."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

SHORT = {"type": "string", "maxLength": 16}

# name -> (what to ask for, schema).
SCHEMAS: dict[str, tuple[str, Schema]] = {
    "person": (
        "a person with a name and an age",
        {
            "type": "object",
            "properties": {"name": SHORT, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
    ),
    "nested": (
        "a user with a name and an address (city and 5-digit zip code)",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "name": SHORT,
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": SHORT,
                                "zip": {"type": "string", "pattern": "[0-9]{5}"},
                            },
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["name", "address"],
                }
            },
            "required": ["user"],
        },
    ),
    "array_items": (
        "a blog post title with one to three tags",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 30},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 10},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["title", "tags"],
        },
    ),
    "enums": (
        "a t-shirt with a color and a size",
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            },
            "required": ["color", "size"],
        },
    ),
    "const": (
        "a report header (version 2)",
        {
            "type": "object",
            "properties": {
                "version": {"const": 2},
                "kind": {"const": "report"},
                "title": SHORT,
            },
            "required": ["version", "kind", "title"],
        },
    ),
    "integer_bounds": (
        "an adult's age and number of children",
        {
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "children": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10},
            },
            "required": ["age", "children"],
        },
    ),
    "number_bounds": (
        "a product price in dollars and a discount rate",
        {
            "type": "object",
            "properties": {
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "discount": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["price", "discount"],
        },
    ),
    "string_lengths": (
        "a three-to-six letter airport code and a city",
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "minLength": 3, "maxLength": 6},
                "city": {"type": "string", "maxLength": 20},
            },
            "required": ["code", "city"],
        },
    ),
    "optional": (
        "an account with an id, and optionally a nickname and an active flag",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "nickname": {"type": "string", "maxLength": 12},
                "active": {"type": "boolean"},
            },
            "required": ["id"],
        },
    ),
    "refs": (
        "a line segment from one point to another",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                }
            },
            "type": "object",
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
        },
    ),
    "any_of": (
        "a setting whose value is a number or a short word",
        {
            "type": "object",
            "properties": {
                "key": {"type": "string", "maxLength": 12},
                "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]},
            },
            "required": ["key", "value"],
        },
    ),
    "array_of_objects": (
        "a shopping list of up to three items with quantities",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": SHORT, "qty": {"type": "integer"}},
                        "required": ["name", "qty"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["items"],
        },
    ),
    "bool_null": (
        "a task status: done or not, and an empty note",
        {
            "type": "object",
            "properties": {"done": {"type": "boolean"}, "note": {"type": "null"}},
            "required": ["done", "note"],
        },
    ),
    "top_level_array": (
        "two to four lottery numbers",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    ),
    "nested_arrays": (
        "a 2x2 matrix of small integers",
        {
            "type": "object",
            "properties": {
                "matrix": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer"},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["matrix"],
        },
    ),
    "integer_enum": (
        "a priority level from 1 to 3 and a label",
        {
            "type": "object",
            "properties": {"level": {"enum": [1, 2, 3]}, "label": SHORT},
            "required": ["level", "label"],
        },
    ),
    "date_format": (
        "an event name and its date",
        {
            "type": "object",
            "properties": {"event": SHORT, "date": {"type": "string", "format": "date"}},
            "required": ["event", "date"],
        },
    ),
    "pattern": (
        "a contact with a name and a phone number like 555-1234",
        {
            "type": "object",
            "properties": {
                "name": SHORT,
                "phone": {"type": "string", "pattern": "[0-9]{3}-[0-9]{4}"},
            },
            "required": ["name", "phone"],
            "additionalProperties": False,
        },
    ),
}

# Numeric bounds: the outlines backend cannot enforce them (strict mode refuses them by name).
NUMERIC_BOUNDS = ("integer_bounds", "number_bounds")

_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPV4 = rf"({_OCTET}\.){{3}}{_OCTET}"
REGEXES: dict[str, tuple[str, str]] = {
    "ipv4": ("the IP address of a home router", IPV4),
    "iso_date": (
        "the date of the first moon landing in ISO format",
        r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    ),
    "phone": ("a US phone number", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
}

EBNF = """root ::= "SELECT " cols " FROM " table " WHERE " col " = " num ";"
cols ::= col | col ", " col
col ::= "id" | "name" | "age" | "email"
table ::= "users" | "orders"
num ::= [1-9] [0-9]?
"""
EBNF_REGEX = (
    r"SELECT (id|name|age|email)(, (id|name|age|email))? FROM (users|orders) "
    r"WHERE (id|name|age|email) = [1-9][0-9]?;"
)

CHOICES = ["positive", "negative", "neutral"]
