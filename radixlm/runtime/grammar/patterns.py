"""Facts about JSON-schema regexes that the normalizer, the strictness check and the backends
rely on: where a pattern's syntax characters are, whether a pattern matches a property name,
whether it matches every name, and a regex for "any name but these".

JSON Schema reads patterns as ECMA-262 regexes, unanchored (a search). Python's ``re`` is used
to decide a match only where it reads the pattern the same way: ASCII pattern and name, escapes
limited to the character classes and punctuation, no ``(?`` group other than ``(?:``. Anything
else is "not decided" (None), and callers then leave the schema as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_SAFE_ESCAPES = frozenset("dDwWsSbB") | frozenset(".-\\/[](){}*+?^$|_:,=!<>#&~ '\"@%;`")
# Characters with a meaning in a regex (outside / inside a character class): escaped.
_SYNTAX = frozenset("\\^$.|?*+()[]{}/")
_CLASS_SYNTAX = frozenset("\\]^-[")


def regex_syntax_positions(pattern: str) -> Iterator[int]:
    """Indices of the characters of ``pattern`` that are syntax: outside escapes (``\\x``) and
    outside character classes (a class's own ``[`` is yielded, its contents are not)."""
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        else:
            yield i
            if ch == "[":
                in_class = True
                if pattern[i + 1 : i + 2] == "]":
                    i += 1
        i += 1


def regex_matches(pattern: str, name: str) -> bool | None:
    """Whether ``pattern`` (an ECMA-262 regex, searched as JSON Schema does) matches the
    property name ``name``; None where that is not decided (see the module docstring)."""
    if not (pattern.isascii() and name.isascii() and name.isprintable()):
        return None
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\":
            if pattern[i + 1 : i + 2] not in _SAFE_ESCAPES:
                return None
            i += 2
            continue
        if pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
            return None
        i += 1
    try:
        return re.search(pattern, name, re.ASCII) is not None
    except re.error:
        return None


def matches_every_name(pattern: str) -> bool:
    """True only if ``pattern`` matches every string: it matches the empty string at the start
    through nothing that looks ahead (no ``$``, ``\\b`` / ``\\B`` or lookaround), so the same
    empty match is found at the start of any string (``.*``, ``^[a-z]*``, ``""``)."""
    if "\\b" in pattern or "\\B" in pattern:
        return False
    if any(pattern[i] == "$" for i in regex_syntax_positions(pattern)):
        return False
    return regex_matches(pattern, "") is True


def _escape(ch: str, in_class: bool) -> str:
    return "\\" + ch if ch in (_CLASS_SYNTAX if in_class else _SYNTAX) else ch


def names_except(names: list[str]) -> str:
    """An anchored regex matching every string except those in ``names`` (no lookaround: a
    trie of the names, leaving it at each node by another character, or ending where no name
    ends). ``[\\s\\S]`` is any character, line terminators included."""
    trie: dict[str, dict] = {}
    for name in names:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = {}

    def body(node: dict[str, dict]) -> str:
        children = sorted(k for k in node if k)
        alts = [] if "" in node else [""]  # the string may end here unless a name ends here
        alts += [_escape(ch, False) + body(node[ch]) for ch in children]
        others = "".join(_escape(ch, True) for ch in children)
        alts.append((f"[^{others}]" if others else "[\\s\\S]") + "[\\s\\S]*")
        return "(?:" + "|".join(alts) + ")"

    return "^" + body(trie) + "$"
