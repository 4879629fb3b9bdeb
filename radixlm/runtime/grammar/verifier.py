"""The verifier beside the grammar: exact checks of what a grammar cannot express.

``SchemaVerifier`` holds the exact (marked) schema of ``relax.relax_schema``; as
``json_track`` follows the generated JSON it answers, where something completes, whether it
may stand:

- a value at a *known position* (reached from the root through ``properties``,
  ``patternProperties``, ``additionalProperties``, ``prefixItems``, ``items``, local ``$ref``
  and ``allOf``: every schema object that applies there for sure) is validated with
  ``jsonschema`` (format checker on) against each applicable object that may refuse it by its
  own keywords (``refuses_own``: a relaxed keyword on it, or below it where no known position
  reaches), but for ``uniqueItems`` and ``propertyNames``, checked in full item by item and
  key by key (below); an object whose relaxed keywords all sit at known positions below it
  had them checked there, as each of those values completed. Positions below ``anyOf`` / ``oneOf`` /
  ``if`` are checked by their nearest known ancestor. The root is always a known position, so
  a finished document is valid.
  ``jsonschema_rs`` (compiled, ~100x faster) validates instead where the two cannot
  disagree: a schema object whose subtree (through its references) holds no regex, format,
  ``multipleOf`` or scope keyword (``_RS_UNSAFE``) and only references into ``$defs`` /
  ``definitions``; the official suite's instances for such schemas get the same verdicts from
  both (a test keeps this true).
- cheaper and earlier: an array item equal to an earlier one (``uniqueItems``), a key against
  ``propertyNames``, the text of an open string against a lookaround ``pattern`` (the ``regex``
  package's partial matching: refused once no continuation can match).

Only value-completing text triggers a validation; other tokens cost a character scan.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import regex

try:
    import jsonschema_rs
except ImportError:  # pragma: no cover - the grammar extra installs it
    jsonschema_rs = None  # type: ignore[assignment]

from radixlm.runtime.grammar.disjoint import json_equal
from radixlm.runtime.grammar.json_track import Nodes
from radixlm.runtime.grammar.relax import VERIFY_KEY
from radixlm.runtime.grammar.schema_facts import finite_values
from radixlm.runtime.grammar.schema_keywords import (
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_VALUES,
    map_subschemas,
    resolve_pointer,
)

_MAX_EXPAND = 64
# Relaxed keywords checked in full as the value is generated, never again where it completes:
# each key against ``propertyNames`` (``key``), each item against the earlier ones (``item``).
_INCREMENTAL = frozenset({"uniqueItems", "propertyNames"})
_MAX_CACHED_SPAN = 256  # longer value texts are validated every time
_MAX_CACHED_VALUES = 4096  # the value / child caches are emptied at this size
_MAP_KEYS = frozenset({*SCHEMA_MAPS, "dependencies"})
_SUBSCHEMA_KEYS = frozenset({*SCHEMA_MAPS, *SCHEMA_VALUES, *SCHEMA_LISTS, "items",
                             "dependencies"})  # fmt: skip
# Keys where ``jsonschema`` and ``jsonschema_rs`` may disagree: regex dialects (``re`` against
# Rust's), format checkers, float arithmetic, resolution scopes. On the official suite's other
# schemas both give the same verdicts (``test_rs_and_jsonschema_agree_on_the_suite``).
_RS_UNSAFE = frozenset({"format", "pattern", "patternProperties", "multipleOf", "$id", "id",
                        "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                        "$recursiveAnchor", "$vocabulary", "contentEncoding", "contentMediaType",
                        "contentSchema", "dependencies"})  # fmt: skip
_RS_REF_ROOTS = ("$defs", "definitions")  # where references ``jsonschema_rs`` follows may point
_RS_REF_PREFIXES = tuple(f"#/{name}/" for name in _RS_REF_ROOTS)


class SchemaVerifier:
    """Immutable after construction but for its caches; shared by every matcher of one
    compiled grammar (the step thread is the only caller)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        self._tainted: dict[int, bool] = {}
        self._own: dict[int, bool] = {}
        self._validated: dict[int, bool] = {}  # id(node) -> ``_validates(node)``
        # (ids of the checked schema objects, value text) -> the refusing keyword or None
        self._values: dict[tuple[tuple[int, ...], str], str | None] = {}
        self._validators: dict[int, Any] = {}
        self._fast: dict[int, Any] = {}  # id(node) -> its jsonschema_rs validator, or None
        # (ids of a position's schema objects, key or index) -> the child position's
        self._children: dict[tuple[tuple[int, ...], str | int], Nodes] = {}
        # An expansion cut at ``_MAX_EXPAND``: a known position may then miss schema objects,
        # and ``value`` checks every tainted object, not only those that refuse on their own.
        self._truncated = False
        self.root: Nodes = self._expand(schema)

    @classmethod
    def from_text(cls, text: str) -> SchemaVerifier:
        return cls(json.loads(text))

    # ---- positions ------------------------------------------------------------------------

    def _expand(self, node: Any) -> Nodes:
        """``node`` and the schema objects that apply with it for sure (local ``$ref``
        targets, ``allOf`` members), each once."""
        out: list[Any] = []
        seen: set[int] = set()
        stack = [node]
        while stack and len(out) < _MAX_EXPAND:
            n = stack.pop()
            if not isinstance(n, dict) or id(n) in seen:
                continue
            seen.add(id(n))
            out.append(n)
            target = resolve_pointer(self.schema, n.get("$ref"))
            if target is not None:
                stack.append(target)
            if isinstance(n.get("allOf"), list):
                stack.extend(reversed(n["allOf"]))
        if stack:
            self._truncated = True
        return tuple(out)

    def child(self, nodes: Nodes, step: str | int) -> Nodes:
        key = (tuple(map(id, nodes)), step)
        hit = self._children.get(key)
        if hit is None:
            if len(self._children) >= _MAX_CACHED_VALUES:
                self._children.clear()
            hit = self._children[key] = self._child(nodes, step)
        return hit

    def _child(self, nodes: Nodes, step: str | int) -> Nodes:
        out: list[Any] = []
        for n in nodes:
            if isinstance(step, int):
                prefix = n.get("prefixItems")
                if isinstance(prefix, list) and step < len(prefix):
                    out.append(prefix[step])
                elif isinstance(n.get("items"), dict):
                    out.append(n["items"])
                continue
            props = n.get("properties")
            matched = isinstance(props, dict) and step in props
            if matched:
                out.append(props[step])
            for pattern, sub in (n.get("patternProperties") or {}).items():
                hit = _search(pattern, step)
                if hit is None:
                    continue  # undecidable here: the ancestors' checks cover it
                if hit:
                    matched = True
                    out.append(sub)
            if not matched and isinstance(n.get("additionalProperties"), dict):
                out.append(n["additionalProperties"])
        return tuple(x for c in out for x in self._expand(c))

    # ---- checks ---------------------------------------------------------------------------

    def tainted(self, node: Any) -> bool:
        """``node``'s subtree (through local ``$ref``) holds a relaxed keyword."""
        key = id(node)
        if key in self._tainted:
            return self._tainted[key]
        self._tainted[key] = False  # a reference cycle back here adds nothing
        found = False
        if isinstance(node, dict):
            found = VERIFY_KEY in node
            subs: list[Any] = []
            map_subschemas(node, lambda s: _collect(subs, s))
            target = resolve_pointer(self.schema, node.get("$ref"))
            if target is not None:
                subs.append(target)
            found = found or any(self.tainted(s) for s in subs)
        self._tainted[key] = found
        return found

    def _validator_for(self, node: Any) -> Any:
        v = self._validators.get(id(node))
        if v is None:
            v = self._validators[id(node)] = self._validator.evolve(schema=node)
        return v

    def _fast_validator(self, node: Any) -> Any:
        """``node``'s ``jsonschema_rs`` validator where it cannot disagree with ``jsonschema``
        (see the module docstring), else None. Compiled once per node, with the draft of
        ``jsonschema``'s validator and the root's ``$defs`` / ``definitions`` beside it."""
        key = id(node)
        if key in self._fast:
            return self._fast[key]
        fast = None
        if jsonschema_rs is not None and isinstance(node, dict) and self._rs_safe(node, set()):
            doc = {k: v for k, v in node.items() if k not in _RS_REF_ROOTS}
            for name in _RS_REF_ROOTS:
                if isinstance(self.schema.get(name), dict):
                    doc[name] = self.schema[name]
            doc["$schema"] = self._validator.META_SCHEMA["$schema"]
            try:
                fast = jsonschema_rs.validator_for(doc)
            except Exception:  # noqa: BLE001 - what it cannot compile, jsonschema validates
                fast = None
        self._fast[key] = fast
        return fast

    def _rs_safe(self, node: Any, seen: set[int]) -> bool:
        """No ``_RS_UNSAFE`` keyword in schema ``node`` or its subschemas (following local
        references, which must point into the root's ``$defs`` / ``definitions``)."""
        if not isinstance(node, dict) or id(node) in seen:
            return True  # a boolean schema, or one checked already
        seen.add(id(node))
        if not _RS_UNSAFE.isdisjoint(node):
            return False
        ref = node.get("$ref")
        if ref is not None:
            target = resolve_pointer(self.schema, ref)
            if not (isinstance(ref, str) and ref.startswith(_RS_REF_PREFIXES)) or target is None:
                return False
            if not self._rs_safe(target, seen):
                return False
        subs: list[Any] = []
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                subs += value.values()
            elif key in SCHEMA_VALUES:
                subs.append(value)
            elif key in SCHEMA_LISTS or key == "items":
                subs += value if isinstance(value, list) else [value]
        return all(self._rs_safe(sub, seen) for sub in subs)

    def _refusal(self, node: Any, instance: Any) -> str | None:
        fast = self._fast_validator(node)
        if fast is not None:
            try:
                if fast.is_valid(instance):
                    return None
                error = next(fast.iter_errors(instance), None)
            except Exception:  # noqa: BLE001 - an instance it cannot take: jsonschema decides
                pass
            else:
                # Named here when its path holds a relaxed keyword; else (an ``anyOf`` whose
                # branches all fail, ...) ``jsonschema``'s ranking of the branches names it.
                keyword = None if error is None else _reported(error.schema_path)
                if keyword is not None:
                    return keyword
        # One lazy pass: the first error names the keyword (``best_match`` of it alone still
        # descends into an ``anyOf`` / ``oneOf`` error's branches; ranking every error would
        # validate the whole value again for a name).
        error = next(self._validator_for(node).iter_errors(instance), None)
        if error is None:
            return None
        return _keyword_of(jsonschema.exceptions.best_match([error]))

    def checks_value(self, nodes: Nodes) -> bool:
        return any(self.tainted(n) for n in nodes)

    def _validates(self, node: Any) -> bool:
        """``refuses_own``, less the relaxed keywords checked as the value is generated
        (``_INCREMENTAL``): a completed value is validated against ``node`` only for the
        others (``value``)."""
        key = id(node)
        if key not in self._validated:
            found = False
            if isinstance(node, dict):
                relaxed = node.get(VERIFY_KEY, ())
                # ``key`` checks each name against a relaxed ``propertyNames`` in full
                names = node.get("propertyNames") if "propertyNames" in relaxed else None
                found = (
                    any(k not in _INCREMENTAL for k in relaxed)
                    or "$dynamicRef" in node
                    or "$recursiveRef" in node
                    or any(s is not names and self.tainted(s) for s in _unnamed_subschemas(node))
                )
            self._validated[key] = found
        return self._validated[key]

    def refuses_own(self, node: Any) -> bool:
        """A value at ``node`` may be refused when it completes although every value inside
        it passed its own checks: ``node`` carries a relaxed keyword, or a subschema holding
        one applies somewhere ``child`` cannot name (``anyOf`` / ``oneOf`` branches, ``not``,
        ``if`` / ``then`` / ``else``, ``contains``, ``unevaluated*``, a ``patternProperties``
        pattern the ``regex`` package cannot read, ...). Otherwise ``value`` can refuse it
        only through a child at a named position, which was checked when it completed."""
        key = id(node)
        if key not in self._own:
            self._own[key] = isinstance(node, dict) and (
                VERIFY_KEY in node
                or "$dynamicRef" in node
                or "$recursiveRef" in node
                or any(self.tainted(s) for s in _unnamed_subschemas(node))
            )
        return self._own[key]

    def checks_own(self, nodes: Nodes) -> bool:
        return any(self.refuses_own(n) for n in nodes)

    def keeps_items(self, nodes: Nodes) -> bool:
        return any(n.get("uniqueItems") is True and VERIFY_KEY in n for n in nodes)

    def checks_prefix(self, nodes: Nodes) -> bool:
        return any("pattern" in n.get(VERIFY_KEY, ()) for n in nodes)

    def checks_key_prefix(self, nodes: Nodes) -> bool:
        return any(_name_pattern(n) is not None for n in nodes)

    def key_prefix(self, nodes: Nodes, text: str) -> str | None:
        for n in nodes:
            pattern = _name_pattern(n)
            if pattern is not None and _partial(pattern, text) is False:
                return "propertyNames"
        return None

    def more_items(self, nodes: Nodes, earlier: tuple[Any, ...]) -> str | None:
        """``uniqueItems`` where the next item comes from a finite set already used up."""
        for n in nodes:
            if n.get("uniqueItems") is not True:
                continue
            for c in self.child((n,), len(earlier)):
                values = finite_values(c)
                if values is not None and all(
                    any(json_equal(v, e) for e in earlier) for v in values
                ):
                    return "uniqueItems"
        return None

    def key(self, nodes: Nodes, key: str) -> str | None:
        for n in nodes:
            if "propertyNames" in n.get(VERIFY_KEY, ()) and "propertyNames" in n:
                if not self._validator_for(n["propertyNames"]).is_valid(key):
                    return "propertyNames"
        return None

    def item(self, nodes: Nodes, earlier: tuple[Any, ...], value: Any) -> str | None:
        if any(json_equal(value, e) for e in earlier):
            return "uniqueItems"
        return None

    def value(self, nodes: Nodes, span: str) -> str | None:
        all_tainted = self._truncated
        checked = [n for n in nodes if self.tainted(n) and (all_tainted or self._validates(n))]
        if not checked:
            return None
        # The answer depends only on the schema objects and the text: the rows of a batch
        # under one schema (and the candidates a scan tries) often complete the same values.
        key = (tuple(id(n) for n in checked), span) if len(span) <= _MAX_CACHED_SPAN else None
        if key is not None and key in self._values:
            return self._values[key]
        instance = json.loads(span)
        refusal = None
        for n in checked:
            refusal = self._refusal(n, instance)
            if refusal is not None:
                break
        if key is not None:
            if len(self._values) >= _MAX_CACHED_VALUES:
                self._values.clear()
            self._values[key] = refusal
        return refusal

    def string_prefix(self, nodes: Nodes, text: str) -> str | None:
        for n in nodes:
            if "pattern" in n.get(VERIFY_KEY, ()) and _partial(n["pattern"], text) is False:
                return "pattern"
        return None


def _collect(into: list[Any], schema: Any) -> Any:
    """``into.append(schema)``, returning ``schema`` (a ``map_subschemas`` visitor)."""
    into.append(schema)
    return schema


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> regex.Pattern[str] | None:
    """``pattern`` compiled once (the ``regex`` module's own cache costs a lookup per call that
    is most of a short search); None when the ``regex`` package cannot read it."""
    try:
        return regex.compile(pattern)
    except regex.error:
        return None


def _partial(pattern: str, text: str) -> bool | None:
    """Whether some continuation of ``text`` can match ``pattern`` (searched); None when the
    ``regex`` package cannot read it (the completed string is checked anyway)."""
    compiled = _compiled(pattern)
    return None if compiled is None else compiled.search(text, partial=True) is not None


# Where ``child`` (and ``_expand``) find the subschemas that apply to a value's children:
# those are checked at the children's own positions. ``$defs`` apply only through a ``$ref``.
_NAMED = frozenset({"properties", "additionalProperties", "prefixItems", "allOf", "$defs",
                    "definitions"})  # fmt: skip


def _unnamed_subschemas(n: dict[str, Any]) -> list[Any]:
    """The direct subschemas of ``n`` that apply where ``child`` cannot name the position."""
    out: list[Any] = []
    for key, value in n.items():
        if key in _NAMED or key not in _SUBSCHEMA_KEYS:
            continue
        if key == "items" and isinstance(value, dict):
            continue
        if key == "patternProperties" and isinstance(value, dict):
            out += [sub for p, sub in value.items() if _compiled(p) is None]
            continue
        values = value.values() if isinstance(value, dict) and key in _MAP_KEYS else [value]
        for v in values:
            out += v if isinstance(v, list) else [v]
    return out


def _name_pattern(n: dict[str, Any]) -> str | None:
    """The ``pattern`` of a relaxed ``propertyNames`` schema, if any."""
    names = n.get("propertyNames")
    if "propertyNames" not in n.get(VERIFY_KEY, ()) or not isinstance(names, dict):
        return None
    pattern = names.get("pattern")
    return pattern if isinstance(pattern, str) else None


def _search(pattern: str, name: str) -> bool | None:
    compiled = _compiled(pattern)
    return None if compiled is None else compiled.search(name) is not None


def _keyword_of(error: Any) -> str:
    """The relaxed keyword a validation error comes from (the deepest one on its schema path,
    else the error's own)."""
    if error is None:
        return "schema"
    return _reported(error.absolute_schema_path) or str(error.validator)


def _reported(path: Any) -> str | None:
    """The deepest relaxed keyword on a validation error's schema path, if any."""
    for p in reversed([p for p in path if isinstance(p, str)]):
        if p in _REPORTED:
            return "if" if p in ("then", "else") else p
    return None


_REPORTED = frozenset({"uniqueItems", "not", "propertyNames", "if", "then", "else", "oneOf",
                       "unevaluatedProperties", "unevaluatedItems", "contains", "pattern",
                       "format"})  # fmt: skip
