"""Facts about JSON-schema regexes that the normalizer, the strictness check and the backends
rely on: where a pattern's syntax characters are, whether a pattern matches a property name,
whether it matches every name, and a regex for "any name but these".

JSON Schema reads patterns as ECMA-262 regexes, unanchored (a search). Python's ``re`` is used
to decide a match only where it reads the pattern the same way: ASCII pattern and name, escapes
limited to the character classes and punctuation, no ``(?`` group other than ``(?:``. Anything
else is "not decided" (None), and callers then leave the schema as it is.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

from radixlm.runtime.grammar.schema_keywords import map_subschemas

_SAFE_ESCAPES = frozenset("dDwWsSbB") | frozenset(".-\\/[](){}*+?^$|_:,=!<>#&~ '\"@%;`")
# Characters with a meaning in a regex (outside / inside a character class): escaped.
_SYNTAX = frozenset("\\^$.|?*+()[]{}/")
_CLASS_SYNTAX = frozenset("\\]^-[")


def regex_atoms(pattern: str) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each top-level piece of ``pattern``: an escape (``\\x``), a
    character class (``[...]``, a ``]`` right after ``[`` / ``[^`` being literal) or one other
    character (syntax or literal)."""
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "\\":
            yield i, min(i + 2, n)
            i += 2
        elif pattern[i] == "[":
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            yield i, min(j + 1, n)
            i = j + 1
        else:
            yield i, i + 1
            i += 1


def regex_syntax_positions(pattern: str) -> Iterator[int]:
    """Indices of the characters of ``pattern`` that are syntax: outside escapes (``\\x``) and
    outside character classes (a class's own ``[`` is yielded, its contents are not)."""
    return (start for start, _ in regex_atoms(pattern) if pattern[start] != "\\")


def is_lookaround_at(pattern: str, i: int) -> bool:
    """``pattern[i]`` is the ``(`` of a lookahead / lookbehind group."""
    return pattern[i + 1 : i + 3] in ("?=", "?!") or pattern[i + 1 : i + 4] in ("?<=", "?<!")


def has_lookaround(pattern: str) -> bool:
    """``pattern`` has a lookahead or lookbehind group (escapes and classes skipped)."""
    return any(
        pattern[i] == "(" and is_lookaround_at(pattern, i) for i in regex_syntax_positions(pattern)
    )


_BACKREFERENCE = re.compile(r"\\[1-9]|\(\?P=|\\k<")
_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")
# Counted repetitions above this are left to the verifier (llguidance's compile time grows
# with them; ``relax._MAX_MIN_LENGTH_WITH_PATTERN`` is the same bound for ``minLength``).
_MAX_COUNT = 64


def without_lookarounds(pattern: str) -> str | None:
    """``pattern`` with its lookahead / lookbehind groups taken out: a pattern that matches
    every string ``pattern`` matches (an assertion only ever refuses), for a grammar to enforce
    while the verifier checks the rest. None where that is not a plain pattern every backend
    reads as Python does: a back-reference (it may name a group inside one), what is left does
    not compile, or has an inner anchor, a top-level ``|``, a piece that can match a backslash,
    a negated piece (``pattern_problems`` of every backend is then empty) or a count above
    ``_MAX_COUNT``."""
    if _BACKREFERENCE.search(pattern):
        return None
    out, depth, cut_from = [], 0, None  # cut_from: the depth where a lookaround group opened
    for start, end in regex_atoms(pattern):
        ch = pattern[start]
        if ch == "(" and cut_from is None and is_lookaround_at(pattern, start):
            cut_from = depth
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if cut_from is not None and depth == cut_from:
                cut_from = None
                continue
        if cut_from is None:
            out.append(pattern[start:end])
    looser = "".join(out)
    try:
        re.compile(looser)
    except re.error:
        return None
    n = len(looser)
    for i in regex_syntax_positions(looser):
        inner_anchor = (looser[i] == "^" and i != 0) or (looser[i] == "$" and i != n - 1)
        if inner_anchor or (looser[i] == "|" and _top_level(looser, i)):
            return None
    if can_match_backslash(looser) or negation_problems(looser, ascii_only=True):
        return None
    counts = (int(b) for m in _COUNTED.finditer(looser) for b in m.groups() if b)
    if any(c > _MAX_COUNT for c in counts):
        return None
    return looser


def _top_level(pattern: str, i: int) -> bool:
    """``pattern[i]`` is outside every group."""
    depth = 0
    for j in regex_syntax_positions(pattern):
        if j >= i:
            break
        depth += {"(": 1, ")": -1}.get(pattern[j], 0)
    return depth == 0


def can_match_backslash(pattern: str) -> bool:
    """Whether some one-character piece of ``pattern`` (``regex_atoms``) can match a
    backslash: ``.``, ``\\\\``, ``\\S``, ``\\W``, ``\\D``, or a class containing it (ranges and
    negation included). A piece Python cannot read counts as yes."""
    for start, end in regex_atoms(pattern):
        try:
            if re.fullmatch(pattern[start:end], "\\"):
                return True
        except re.error:
            if pattern[start] in "\\[":
                return True
    return False


# Escapes that can name a character beyond ASCII (``\\s`` holds U+00A0, ``\\u00e9``, ...).
_WIDE_ESCAPES = frozenset("sSwWdDpPux")


def negation_problems(pattern: str, ascii_only: bool) -> list[str]:
    """Why the negated pieces of ``pattern`` may let through what they exclude: on a backend
    whose negated classes exclude only ASCII characters exactly (``ascii_only``; xgrammar:
    ``[^é]`` admits ``\\u00e9``, ``\\S`` admits U+00A0), and on every backend ``\\W`` /
    ``\\D`` and their negated classes, which ``jsonschema`` reads over Unicode word characters
    and digits and the backends over ASCII. A negated class that excludes ``"`` or ``\\``
    is never given to llguidance (``positive_classes``)."""
    found: list[str] = []
    for start, end in regex_atoms(pattern):
        piece = pattern[start:end]
        negated = piece.startswith("[^")
        if (
            piece in ("\\W", "\\D")
            or (negated and re.search(r"\\[wd]", piece))
            or (piece.startswith("[") and not negated and re.search(r"\\[WD]", piece))
        ):
            found.append(f"{piece} (read over Unicode by jsonschema, over ASCII here)")
        elif ascii_only and (piece == "\\S" or (negated and not _ascii_members(piece))):
            found.append(f"{piece} (exact only for excluded ASCII characters)")
    return found


def positive_classes(pattern: str, chars: str = '"\\') -> str | None:
    """``pattern`` with every negated class ``[^...]`` that excludes one of ``chars`` written
    as the positive class of what it admits from U+0020 to U+FFFF (Python's reading, which is
    ``jsonschema``'s); None when such a class cannot be read. Over-strict, never wider: control
    characters, surrogates and characters past U+FFFF are left out. For llguidance, whose
    negated classes let an excluded quote or backslash through as its JSON escape (and whose
    classes holding control characters admit every escape)."""
    out, last = [], 0
    for start, end in regex_atoms(pattern):
        atom = pattern[start:end]
        if atom.startswith("[^") and any(_excludes(atom, ch) for ch in chars):
            positive = _positive_class(atom)
            if positive is None:
                return None
            out += [pattern[last:start], positive]
            last = end
    return "".join([*out, pattern[last:]])


@functools.lru_cache(maxsize=256)
def _positive_class(negated_class: str) -> str | None:
    try:
        rx = re.compile(negated_class)
    except re.error:
        return None
    ranges: list[list[int]] = []
    for cp in range(0x20, 0x10000):
        if 0xD800 <= cp <= 0xDFFF or rx.fullmatch(chr(cp)) is None:
            continue
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    if not ranges:
        return None
    return "[" + "".join(f"\\u{a:04x}" + (f"-\\u{b:04x}" if b > a else "") for a, b in ranges) + "]"


ANY_TEXT = "[\\s\\S]*"  # any characters, line terminators included (ECMA's ``.`` excludes them)
# Any characters a JSON string holds unescaped: for a backend that matches the escaped text.
UNESCAPED_TEXT = '[^"\\\\\\x00-\\x1f]*'


def as_full_match(pattern: str, any_text: str = ANY_TEXT) -> str:
    """A regex whose full matches are the strings that ``pattern`` (JSON Schema's: a search,
    unanchored) matches somewhere, for a backend that reads schema patterns as full matches
    (xgrammar 0.2.8: its issue #838). ``^X$`` stays; ``^X`` -> ``(?:X)[\\s\\S]*``; ``X$`` ->
    ``[\\s\\S]*(?:X)``; ``X`` -> both (``any_text`` for ``[\\s\\S]*``: ``UNESCAPED_TEXT`` where
    the text is matched escaped, stricter). A pattern with another anchor (inside a group, or
    beside a top-level ``|``) is left as it is: matched in full, stricter than the schema,
    never looser."""
    anchors = _end_anchors(pattern)
    if anchors is None or anchors == (True, True):
        return pattern
    lead, trail = anchors
    body = pattern[1 if lead else 0 : len(pattern) - 1 if trail else len(pattern)]
    return f"{'' if lead else any_text}(?:{body}){'' if trail else any_text}"


def plainly_anchored(pattern: str) -> bool:
    """``pattern`` is ``^X$`` with no other anchor and no top-level ``|``: its searches and
    its full matches are the same strings (every backend reads it alike)."""
    return _end_anchors(pattern) == (True, True)


def _end_anchors(pattern: str) -> tuple[bool, bool] | None:
    """Whether ``pattern`` starts with ``^`` / ends with ``$``; None when it has another
    anchor, or one of those beside a top-level ``|`` (``^a|b``: it belongs to one branch)."""
    positions = list(regex_syntax_positions(pattern))
    n = len(pattern)
    lead = n > 0 and pattern[0] == "^"
    trail = n > 0 and pattern[-1] == "$" and (n - 1) in positions  # ``\\$`` is a literal
    for i in positions:
        if pattern[i] in "^$" and not (i == 0 and lead) and not (i == n - 1 and trail):
            return None
    if (lead or trail) and any(pattern[i] == "|" and _top_level(pattern, i) for i in positions):
        return None
    return lead, trail


def map_patterns(schema: Any, fn: Callable[[str], str], depth: int = 0) -> Any:
    """``fn`` applied to every ``pattern`` and ``patternProperties`` key of ``schema``."""
    if not isinstance(schema, dict) or depth > 128:
        return schema
    out = map_subschemas(schema, lambda v: map_patterns(v, fn, depth + 1))
    if isinstance(out.get("pattern"), str):
        out["pattern"] = fn(out["pattern"])
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {fn(k): v for k, v in out["patternProperties"].items()}
    return out


def _excludes(negated_class: str, ch: str) -> bool:
    try:
        return re.fullmatch(negated_class, ch) is None
    except re.error:
        return True  # unreadable: assume the worst


def _ascii_members(negated_class: str) -> bool:
    """Whether every character ``[^...]`` excludes is ASCII (written in ASCII, and no escape
    that can name a wider character)."""
    body = negated_class[2:-1]
    escapes = [body[i + 1 : i + 2] for i in range(len(body)) if body[i] == "\\"]
    return body.isascii() and not any(e in _WIDE_ESCAPES for e in escapes)


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


# ``\s`` spelled out: every character that Python's ``re`` (as ``jsonschema`` runs it) or
# ECMA-262 counts as white space. A negated class written with it excludes both readings.
_ANY_SPACE = (
    "\\t\\n\\v\\f\\r \\x1c-\\x1f\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f"
    "\\u3000\\ufeff"
)


def _negated_class(atom: str, also: str = "") -> str | None:
    """The negation of a one-character regex ``atom``: a class ``[...]`` (not itself negated)
    or ``\\s``. None for anything else, and for classes holding ``\\d`` / ``\\w`` (whose
    Unicode reading differs between ``jsonschema`` and ECMA-262) or ``\\b``. ``also``: more
    (escaped) characters to exclude."""
    if atom == "\\s":
        return f"[^{also}{_ANY_SPACE}]"
    if len(atom) < 3 or atom[0] != "[" or atom[-1] != "]" or atom[1] == "^":
        return None
    body = atom[1:-1]
    out, i = [], 0
    while i < len(body):  # one class: no unescaped "[" or "]" inside
        ch = body[i]
        if ch == "\\":
            esc = body[i + 1 : i + 2]
            if esc in ("d", "D", "w", "W", "S", "b", "B", ""):
                return None
            out.append(_ANY_SPACE if esc == "s" else body[i : i + 2])
            i += 2
            continue
        if ch in "[]":
            return None
        out.append(ch)
        i += 1
    if body.startswith("]"):
        return None
    if out[0] == "-":  # literal at the start; escaped, since `also` goes before it
        out[0] = "\\-"
    return "[^" + also + "".join(out) + "]"  # `also` first: a final "-" stays literal


def pattern_complement(pattern: str) -> str | None:
    """A regex matching the strings that ``pattern`` (searched) does not match, for the
    one-class forms ``^C*$``, ``^C+$`` and ``C``; None for any other pattern. Exact but for
    the characters that only one of Python's and ECMA-262's readings puts in a class or at the
    end (U+FEFF as white space, a final newline before ``$``): strings hinging on those are
    left out (over-strict under either reading, never wrong)."""
    if regex_matches(pattern, "") is None:
        return None  # not read the same way by Python and ECMA-262
    anchored = pattern.startswith("^") and pattern.endswith(("*$", "+$"))
    if anchored and not pattern.endswith(("\\*$", "\\+$")):
        # Python's "$" (jsonschema's reading) also matches before a final newline: the other
        # character must not be a newline, or "ab\\n" would pass here and fail there.
        negated = _negated_class(pattern[1:-2], also="\\n")
        if negated is None:
            return None
        some_other = f"[\\s\\S]*{negated}[\\s\\S]*"  # a character outside the class
        return f"^{some_other}$" if pattern[-2] == "*" else f"^(?:{some_other})?$"
    negated = _negated_class(pattern)
    return None if negated is None else f"^{negated}*$"  # no character of the class
