"""An incremental JSON scanner that reports where values complete (the verifier's eyes).

``advance(state, text, hooks)`` follows generated text and, at each point where something
completes, asks ``hooks`` whether it may stand: a key (its closing quote), an array item
(``hooks.item``, against the earlier items), any value (``hooks.value``: a string at its closing
quote, a number at the character after it or at ``finish``, ``true`` / ``false`` / ``null`` at
their first character (the rest is forced), an object / array at its closing bracket), and an
open string's text so far (``hooks.string_prefix`` / ``key_prefix``, once per call), and an
array separator (``hooks.more_items``: can another item still stand?). The first refusal names its
keyword and leaves ``state`` as it was.

The text is assumed to be a prefix of JSON (the grammar guarantees it); states are immutable,
so a matcher keeps one per accepted token (rollback drops the last ones) and tries a
candidate without changing anything. Schema positions are opaque ``Nodes`` that ``hooks.child``
derives from the parent's (the root's are given).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

Nodes = tuple[Any, ...]
_NUMBER_CHARS = frozenset("0123456789+-.eE")
NUMBER_BYTES = frozenset(b"0123456789+-.eE")  # a number's characters, as bytes
_LITERALS = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}
_WHITESPACE = frozenset(" \t\n\r")


class Hooks(Protocol):
    """What the scanner asks; each check returns the refusing keyword, or None."""

    def child(self, nodes: Nodes, step: str | int) -> Nodes: ...
    def keeps_items(self, nodes: Nodes) -> bool: ...
    def checks_prefix(self, nodes: Nodes) -> bool: ...
    def checks_key_prefix(self, nodes: Nodes) -> bool: ...
    def more_items(self, nodes: Nodes, earlier: tuple[Any, ...]) -> str | None: ...
    def key_prefix(self, nodes: Nodes, text: str) -> str | None: ...
    def key(self, nodes: Nodes, key: str) -> str | None: ...
    def item(self, nodes: Nodes, earlier: tuple[Any, ...], value: Any) -> str | None: ...
    def value(self, nodes: Nodes, span: str) -> str | None: ...
    def string_prefix(self, nodes: Nodes, text: str) -> str | None: ...
    def checks_value(self, nodes: Nodes) -> bool:
        """``value`` may refuse a value at ``nodes`` (a relaxed keyword applies there)."""
        ...

    def checks_own(self, nodes: Nodes) -> bool:
        """A value at ``nodes`` may be refused when it completes although every value
        inside it passed its own checks (``SchemaVerifier.refuses_own``)."""
        ...


# NOTE: the states are named tuples, not frozen dataclasses: one is built per character that
# opens, separates or closes something, for every candidate token (~3x faster to build).


class Frame(NamedTuple):
    """An open object / array. ``started``: items (members) started; ``items``: completed items,
    kept only where ``hooks.keeps_items``; ``key``: the member whose value comes next."""

    array: bool
    start: int
    nodes: Nodes
    started: int = 0
    items: tuple[Any, ...] = ()
    key: str | None = None
    want_key: bool = True


class Scalar(NamedTuple):
    """An open string (``key``: an object key), number or literal (``left`` chars to come)."""

    kind: str  # "string" | "number" | "literal"
    start: int
    nodes: Nodes
    key: bool = False
    escape: bool = False
    left: int = 0
    prefix_check: bool = False


class ScanState(NamedTuple):
    text: str = ""
    stack: tuple[Frame, ...] = ()
    scalar: Scalar | None = None
    done: bool = False
    pending: bytes = b""  # an incomplete UTF-8 character at the end of the bytes fed


class Refused(Exception):  # noqa: N818 - a control-flow signal, caught in this module
    def __init__(self, keyword: str) -> None:
        self.keyword = keyword


def decode_partial(data: bytes) -> tuple[str, bytes]:
    """(text, incomplete tail) of UTF-8 ``data`` cut before an incomplete last character."""
    for cut in range(min(3, len(data)) + 1):
        try:
            return data[: len(data) - cut].decode("utf-8"), data[len(data) - cut :]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace"), b""


def advance_bytes(state: ScanState, data: bytes, hooks: Hooks, root: Nodes) -> ScanState | str:
    """``advance`` on UTF-8 bytes (a token's), keeping an incomplete character for later."""
    sc = state.scalar
    if sc is not None and not state.pending:
        if sc.kind == "string" and not sc.escape:
            inside = _inside_string(state, sc, data, hooks)
            if inside is not None:
                return inside
        elif sc.kind == "number" and all(b in NUMBER_BYTES for b in data):
            # digits that continue an open number: nothing completes, nothing is checked
            return ScanState(state.text + data.decode("ascii"), state.stack, sc, state.done)
    text, pending = decode_partial(state.pending + data)
    # NOTE: the states are rebuilt by hand, not with ``_replace`` (slower): this runs once per
    # candidate token.
    if state.pending:
        state = ScanState(state.text, state.stack, state.scalar, state.done)
    out = advance(state, text, hooks, root)
    if not isinstance(out, ScanState):
        return out
    sc = out.scalar
    if pending and sc is not None and sc.kind == "string" and sc.prefix_check and not sc.escape:
        # An incomplete character inside a checked string: refused when no character it can
        # complete to continues the text (else every continuation is a dead end).
        prefix = _decoded_prefix(out.text[sc.start + 1 :])
        if prefix is not None:
            check = hooks.key_prefix if sc.key else hooks.string_prefix
            keyword = None
            for ch in utf8_completions(pending):
                keyword = check(sc.nodes, prefix + ch)
                if keyword is None:
                    break
            if keyword is not None:
                return keyword
    if not pending:
        return out  # ``_Scan.state`` leaves ``pending`` empty
    return ScanState(out.text, out.stack, out.scalar, out.done, pending)


def utf8_size(lead: int) -> int:
    """The length of the UTF-8 character whose first byte is ``lead``."""
    return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def utf8_completions(pending: bytes, most: int = 64) -> list[str]:
    """Characters that the incomplete UTF-8 sequence ``pending`` can complete to: all of them
    when there are at most ``most`` (one continuation byte missing), else ``most`` spread
    over the range (a refusal is then over-strict for a pattern that admits only characters
    between them; whole-character tokens are still checked exactly)."""
    missing = utf8_size(pending[0]) - len(pending)
    if missing <= 0:
        return []
    total = 64**missing
    step = max(1, total // most)
    out = []
    for k in range(0, total, step):
        tail = bytes(0x80 + (k >> (6 * (missing - 1 - j)) & 0x3F) for j in range(missing))
        try:
            out.append((pending + tail).decode("utf-8"))
        except UnicodeDecodeError:
            continue  # overlong, surrogate or past U+10FFFF
    return out


def _inside_string(
    state: ScanState, sc: Scalar, data: bytes, hooks: Hooks
) -> ScanState | str | None:
    """The fast path of ``advance_bytes`` for whole characters that stay inside an open string
    (no quote, no backslash): only the prefix check runs. None: not such ``data``."""
    if b'"' in data or b"\\" in data:
        return None
    try:
        chunk = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = state.text + chunk
    if sc.prefix_check:
        prefix = _decoded_prefix(text[sc.start + 1 :])
        if prefix is not None:
            check = hooks.key_prefix if sc.key else hooks.string_prefix
            keyword = check(sc.nodes, prefix)
            if keyword is not None:
                return keyword
    return ScanState(text, state.stack, sc, state.done)


def advance(state: ScanState, chunk: str, hooks: Hooks, root: Nodes) -> ScanState | str:
    """The state after ``chunk``, or the keyword that refuses it."""
    try:
        scan = _Scan(state, hooks, root)
        scan.run(chunk)
        return scan.state()
    except Refused as exc:
        return exc.keyword


def advance_value(
    state: ScanState, chunk: str, hooks: Hooks, root: Nodes
) -> tuple[ScanState, int] | str:
    """``advance`` through the end of the top-level value at most (a value embedded in other
    text, e.g. a tool call's arguments): the state and how many characters of ``chunk`` it
    took; the value has ended when ``ended(state)``. A top-level number ends at the first
    character after it, which is not taken."""
    try:
        scan = _Scan(state, hooks, root)
        taken = scan.run(chunk, stop=True)
        return scan.state(), taken
    except Refused as exc:
        return exc.keyword


def open_checked(state: ScanState, hooks: Hooks) -> int | None:
    """The start (an offset in ``state.text``) of the outermost open value whose completion
    ``hooks`` may refuse on account of its own keywords (``hooks.checks_own``: an array with
    ``uniqueItems``, an object with ``propertyNames``, a value under ``not`` / ``if`` /
    ``oneOf``, a string with a prefix check, ...); None when there is none. Every open value
    that starts before it completes only through checks of values inside it, each named at
    its own position, so a refusal met later can be undone by taking back text after that
    start. Monotone: as text is appended the offset never decreases (the values outside it
    cannot refuse, and the next such value starts after it ends)."""
    for frame in state.stack:
        if hooks.checks_own(frame.nodes):
            return frame.start
    sc = state.scalar
    if sc is not None and not sc.key and sc.kind != "literal":  # literals: checked at once
        if sc.prefix_check or hooks.checks_own(sc.nodes):
            return sc.start
    return None


def first_char_refuser(state: ScanState, hooks: Hooks) -> Callable[[bytes], str | None] | None:
    """Inside an open string with a prefix check (no escape in it, no incomplete character):
    a test of a token's bytes that names the keyword refusing the string's text followed by
    the token's first character alone, else None (not refused by it: feed the token). A
    refusal is exact: no continuation of that text can match, so every token starting with that
    character is refused by ``advance_bytes`` too (its prefix check, or the check of the
    completed string). One check per distinct first character. None when ``state`` is not
    there (nothing to test)."""
    sc = state.scalar
    if sc is None or sc.kind != "string" or not sc.prefix_check or sc.escape or state.pending:
        return None
    raw = state.text[sc.start + 1 :]
    if "\\" in raw:
        return None  # the decoded prefix is what the text spells only without escapes
    check = hooks.key_prefix if sc.key else hooks.string_prefix
    nodes = sc.nodes
    verdicts: dict[str, str | None] = {}

    def refuses(data: bytes) -> str | None:
        lead = data[:1]
        if not lead or lead in b'"\\':
            return None
        try:
            ch = data[: utf8_size(lead[0])].decode("utf-8")
        except UnicodeDecodeError:
            return None  # an incomplete (or invalid) first character: feed it
        if ch not in verdicts:
            verdicts[ch] = check(nodes, raw + ch)
        return verdicts[ch]

    return refuses


def ended(state: ScanState) -> bool:
    """The top-level value is complete (and no literal is still being spelled)."""
    return state.done and state.scalar is None


def finish(state: ScanState, hooks: Hooks, root: Nodes) -> ScanState | str:
    """The end of the text (EOS): a top-level number completes here."""
    if state.scalar is None or state.scalar.kind != "number":
        return state
    try:
        scan = _Scan(state, hooks, root)
        scan.end_number(len(state.text))
        return scan.state()
    except Refused as exc:
        return exc.keyword


class _Scan:
    def __init__(self, state: ScanState, hooks: Hooks, root: Nodes) -> None:
        self.text = state.text
        self.stack = list(state.stack)
        self.scalar = state.scalar
        self.done = state.done
        self.hooks = hooks
        self.root = root

    def state(self) -> ScanState:
        return ScanState(self.text, tuple(self.stack), self.scalar, self.done)

    def run(self, chunk: str, stop: bool = False) -> int:
        """Scan ``chunk``; with ``stop``, only up to the end of the top-level value. Returns
        the characters taken."""
        base = len(self.text)
        self.text += chunk
        taken = len(chunk)
        for k, ch in enumerate(chunk):
            if stop and self.done and self.scalar is None:
                taken = k
                break
            if not self.char(ch, base + k, stop):
                taken = k
                break
        self.text = self.text[: base + taken]
        sc = self.scalar
        if sc is not None and sc.prefix_check and sc.kind == "string":
            raw = self.text[sc.start + 1 :]
            prefix = _decoded_prefix(raw)
            if prefix is not None:
                check = self.hooks.key_prefix if sc.key else self.hooks.string_prefix
                self._check(check(sc.nodes, prefix))
        return taken

    def char(self, ch: str, pos: int, stop: bool = False) -> bool:
        """Scan one character; False when it is not taken (``stop``: it follows a top-level
        number, which it ended)."""
        sc = self.scalar
        if sc is not None:
            if sc.kind == "string":
                if sc.escape:
                    self.scalar = sc._replace(escape=False)
                elif ch == "\\":
                    self.scalar = sc._replace(escape=True)
                elif ch == '"':
                    self.end_string(pos)
                return True
            if sc.kind == "literal":
                self.scalar = sc._replace(left=sc.left - 1) if sc.left > 1 else None
                return True
            if ch in _NUMBER_CHARS:
                return True
            self.end_number(pos)
            if stop and self.done:
                return False
        self.structural(ch, pos)
        return True

    def structural(self, ch: str, pos: int) -> None:
        if ch in _WHITESPACE:
            return
        top = self.stack[-1] if self.stack else None
        if ch == ":" and top is not None:
            self.stack[-1] = Frame(
                top.array, top.start, top.nodes, top.started, top.items, top.key, False
            )
        elif ch == "," and top is not None:
            if top.array and self.hooks.keeps_items(top.nodes):
                self._check(self.hooks.more_items(top.nodes, top.items))
            self.stack[-1] = Frame(
                top.array, top.start, top.nodes, top.started, top.items, None, True
            )
        elif ch in "}]" and top is not None:
            self.stack.pop()
            self.complete(top.nodes, self.text[top.start : pos + 1])
        elif ch == '"' and top is not None and not top.array and top.want_key:
            prefix = self.hooks.checks_key_prefix(top.nodes)
            self.scalar = Scalar("string", pos, top.nodes, key=True, prefix_check=prefix)
        else:
            self.start_value(ch, pos)

    def start_value(self, ch: str, pos: int) -> None:
        nodes = self.slot()
        if ch in "{[":
            self.stack.append(Frame(ch == "[", pos, nodes))
        elif ch == '"':
            prefix = self.hooks.checks_prefix(nodes)
            self.scalar = Scalar("string", pos, nodes, prefix_check=prefix)
        elif ch in _LITERALS:
            word, _ = _LITERALS[ch]
            self.scalar = Scalar("literal", pos, nodes, left=len(word) - 1)
            self.complete(nodes, word)
        else:
            self.scalar = Scalar("number", pos, nodes)

    def slot(self) -> Nodes:
        """Schema nodes of the value starting now (an array item starts here)."""
        if not self.stack:
            return self.root
        top = self.stack[-1]
        if top.array:
            self.stack[-1] = Frame(
                top.array, top.start, top.nodes, top.started + 1, top.items, top.key, top.want_key
            )
            return self.hooks.child(top.nodes, top.started)
        return self.hooks.child(top.nodes, top.key if top.key is not None else "")

    def end_string(self, pos: int) -> None:
        sc = self.scalar
        assert sc is not None
        self.scalar = None
        span = self.text[sc.start : pos + 1]
        if sc.key:
            key = json.loads(span)
            self._check(self.hooks.key(sc.nodes, key))
            top = self.stack[-1]
            self.stack[-1] = Frame(
                top.array, top.start, top.nodes, top.started, top.items, key, top.want_key
            )
        else:
            self.complete(sc.nodes, span)

    def end_number(self, pos: int) -> None:
        sc = self.scalar
        assert sc is not None
        self.scalar = None
        self.complete(sc.nodes, self.text[sc.start : pos])

    def complete(self, nodes: Nodes, span: str) -> None:
        self._check(self.hooks.value(nodes, span))
        if not self.stack:
            self.done = True
            return
        top = self.stack[-1]
        if top.array and self.hooks.keeps_items(top.nodes):
            value = json.loads(span)
            self._check(self.hooks.item(top.nodes, top.items, value))
            self.stack[-1] = Frame(
                top.array,
                top.start,
                top.nodes,
                top.started,
                (*top.items, value),
                top.key,
                top.want_key,
            )

    @staticmethod
    def _check(keyword: str | None) -> None:
        if keyword is not None:
            raise Refused(keyword)


def _decoded_prefix(raw: str) -> str | None:
    """The string value spelled so far by JSON string text ``raw`` (after its opening quote),
    an escape still incomplete at its end left out (every continuation of the value starts
    with the text before it); None when that cannot be decoded."""
    if "\\" not in raw:
        return raw  # no escape: the text is the value (the grammar admits no control character)
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        pass
    cut = raw.rfind("\\")  # ``\``, ``\u00`` at the end (an earlier ``\\`` stays whole)
    try:
        return json.loads(f'"{raw[:cut]}"')
    except ValueError:
        return None
