"""String ``format``s against the official suite's optional format tests (assertion semantics).

For every backend and every format in its ``schema_support.formats`` (and every format the
normalizer rewrites to an exact pattern, ``formats.FORMAT_PATTERNS``), ``{"type": "string",
"format": F}`` is compiled on ``BYTE_VOCAB`` and each *string* instance of
tests/data/json_schema_test_suite/<draft>/optional/format/F.json is walked through it in every
compact serialization: every instance the suite marks invalid must be rejected; valid ones
accepted are counted (over-strictness is allowed and reported). Two validators nobody here wrote
are a second opinion: ``jsonschema``'s 2020-12 ``FORMAT_CHECKER`` (where it has a checker) and
``jsonschema_rs`` with format validation must accept whatever the grammar accepts (they are
laxer than the suite in places, so only that direction is asserted).
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import random
import re
from dataclasses import dataclass, field

import jsonschema
import jsonschema_rs
import pytest
from grammar_helpers import BACKENDS, BYTE_VOCAB, grammar_accepts
from test_grammar_json_schema_suite import SUITE, serializations

from radixlm.runtime.grammar.base import get_backend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.formats import FORMAT_PATTERNS
from radixlm.runtime.grammar.normalize import normalize_schema

FORMAT_BACKENDS = (*BACKENDS, "auto")
_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _references_accept(fmt: str, data: str) -> bool:
    rs = jsonschema_rs.validator_for({"format": fmt}, validate_formats=True)
    return rs.is_valid(data) and (fmt not in _CHECKER.checkers or _CHECKER.conforms(data, fmt))


def _claimed(backend: str) -> list[str]:
    if backend == "auto":
        names: set[str] = set()
        for b in BACKENDS:
            names |= get_backend(b).schema_support.formats
    else:
        names = set(get_backend(backend).schema_support.formats)
    return sorted(names | set(FORMAT_PATTERNS))


def _instances(fmt: str) -> list[tuple[str, str, bool]]:
    """(where, string instance, valid) from every draft's optional format file for ``fmt``."""
    out = []
    for path in sorted(SUITE.glob(f"*/optional/format/{fmt}.json")):
        for group in json.loads(path.read_text()):
            for case in group["tests"]:
                if isinstance(case["data"], str):
                    where = f"{path.parts[-4]} {group['description']} / {case['description']}"
                    out.append((where, case["data"], case["valid"]))
    return out


@dataclass
class FormatTally:
    refused: str = ""  # why strict mode refused the schema ("" when compiled)
    invalid: int = 0
    invalid_rejected: int = 0
    valid: int = 0
    valid_accepted: int = 0
    escaped: list[str] = field(default_factory=list)
    checker_disagrees: list[str] = field(default_factory=list)


_TALLIES: dict[tuple[str, str], FormatTally] = {}


def _cases() -> list[tuple[str, str]]:
    return [(b, f) for b in FORMAT_BACKENDS for f in _claimed(b)]


@pytest.mark.parametrize(("backend", "fmt"), _cases())
def test_format_invalid_instances_are_rejected(backend: str, fmt: str) -> None:
    cases = _instances(fmt)
    assert cases, f"no suite tests vendored for format {fmt!r}"
    t = FormatTally()
    _TALLIES[(backend, fmt)] = t
    c = Constraint.from_params(json_schema={"type": "string", "format": fmt})
    assert c is not None
    try:
        grammar = get_backend(backend)(BYTE_VOCAB).compile(c)
    except GrammarError as exc:
        # Refusing is only allowed for formats the backend does not claim.
        t.refused = str(exc)
        claimed = backend == "auto" or fmt in get_backend(backend).schema_support.formats
        assert fmt not in FORMAT_PATTERNS and not claimed, f"refused: {exc}"
        return
    for where, data, valid in cases:
        texts = serializations(data, {})
        hits = [s for s in texts if grammar_accepts(grammar.new_matcher(), s)]
        if valid:
            t.valid += 1
            t.valid_accepted += bool(hits)
        else:
            t.invalid += 1
            t.invalid_rejected += not hits
            t.escaped.extend(f"{where}: {s}" for s in hits)
        if hits and not _references_accept(fmt, data):
            t.checker_disagrees.append(f"{where}: {data!r}")
    assert not t.escaped, f"{backend} accepts invalid {fmt}:\n" + "\n".join(t.escaped)
    disagree = "\n".join(t.checker_disagrees)
    assert not disagree, f"jsonschema / jsonschema_rs reject what {backend} accepts:\n{disagree}"
    assert t.valid_accepted > 0, f"{backend} accepts no valid {fmt}"


def test_auto_serves_every_format_some_backend_serves() -> None:
    """Per format: `auto` is refused only where every backend is (runs after the format runs
    above); and every format with an exact pattern of our own is served by every backend."""
    if len(_TALLIES) < len(_cases()):
        pytest.skip("needs the format runs above")
    formats = {fmt for _, fmt in _TALLIES}
    for fmt in sorted(formats):
        served = {b for (b, f), t in _TALLIES.items() if f == fmt and not t.refused}
        if served - {"auto"}:
            assert "auto" in served or ("auto", fmt) not in _TALLIES, fmt
        if fmt in FORMAT_PATTERNS:
            assert served == {b for (b, f) in _TALLIES if f == fmt}, (fmt, served)


# ---- the regexes themselves, against references nobody here wrote ---------------------------


def _full(fmt: str, text: str) -> bool:
    return re.fullmatch(FORMAT_PATTERNS[fmt][1:-1], text) is not None


def _rs_accepts(fmt: str, text: str) -> bool:
    return jsonschema_rs.validator_for({"format": fmt}, validate_formats=True).is_valid(text)


def test_date_pattern_is_exact() -> None:
    """Every month/day in sample years (with century and 400-year leap rules), and Feb 29 of
    every year 0001-9999, against ``datetime.date``."""
    years = [1, 4, 100, 400, 1600, 1700, 1900, 1999, 2000, 2004, 2023, 2024, 2100, 2400, 9996]
    cases = [(y, m, d) for y in years for m in range(0, 14) for d in range(0, 33)]
    cases += [(y, 2, 29) for y in range(1, 10_000)]
    for y, m, d in cases:
        try:
            datetime.date(y, m, d)
            valid = True
        except ValueError:
            valid = False
        assert _full("date", f"{y:04d}-{m:02d}-{d:02d}") == valid, (y, m, d)
    assert _full("date", "0000-02-29")  # year 0 is divisible by 400 (RFC 3339 appendix C)


def test_time_pattern_is_exact_or_a_subset() -> None:
    """Seconds 00-59 exactly; a leap second is accepted only where it is 23:59:60 UTC, and for
    every offset with 00/15/30/45 minutes (the documented subset) it is."""
    for h, m, s in itertools.product(range(26), range(62), range(62)):
        if s == 60:
            continue
        valid = h < 24 and m < 60 and s < 60
        assert _full("time", f"{h:02d}:{m:02d}:{s:02d}Z") == valid, (h, m, s)
    day = datetime.datetime(2000, 1, 1)
    for sign, oh, om in itertools.product((1, -1), range(24), range(60)):
        offset = datetime.timedelta(hours=oh, minutes=om) * sign
        text_offset = f"{'+' if sign > 0 else '-'}{oh:02d}:{om:02d}"
        # the one local time that is 23:59 UTC with this offset
        local = (day.replace(hour=23, minute=59) + offset).time()
        for h, m in {(local.hour, local.minute), (23, 59), (local.hour, (local.minute + 1) % 60)}:
            utc = (day.replace(hour=h, minute=m) - offset).time()
            valid = (utc.hour, utc.minute) == (23, 59)
            text = f"{h:02d}:{m:02d}:60{text_offset}"
            if _full("time", text):
                assert valid, text
            elif valid:
                assert om not in (0, 15, 30, 45), text
    assert _full("time", "23:59:60.5z") and not _full("time", "22:59:60Z")


def _ipv6_variants(rng: random.Random) -> list[str]:
    groups = [rng.choice((0, 0, 1, 0xFFFF, rng.randrange(0x10000))) for _ in range(8)]
    addr = ipaddress.IPv6Address(":".join(f"{g:x}" for g in groups))
    out = [addr.compressed, addr.exploded, addr.exploded.upper()]
    v4 = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    out.append(addr.exploded.rsplit(":", 2)[0] + ":" + str(v4))
    text = rng.choice(out)
    for _ in range(rng.randrange(3)):  # mutations: many are no longer addresses
        i = rng.randrange(len(text) + 1)
        op = rng.randrange(3)
        ch = rng.choice("0f:.1")
        text = text[:i] + ch + text[i:] if op == 0 else text[:i] + text[i + 1 :]
    return [*out, text]


def test_ip_patterns_are_exact() -> None:
    """Random (and mutated) addresses against ``ipaddress`` (no leading zeros in IPv4 octets;
    IPv6 without zone ids)."""
    rng = random.Random(0)
    for _ in range(3000):
        parts = [rng.choice((str(rng.randrange(300)), f"0{rng.randrange(10)}", "")) for _ in "..."]
        parts += [str(rng.randrange(256))] * rng.randrange(2)
        text = ".".join(parts)
        try:
            valid = bool(ipaddress.IPv4Address(text))
        except ValueError:
            valid = False
        assert _full("ipv4", text) == valid, text
    for _ in range(2000):
        for text in _ipv6_variants(rng):
            try:
                valid = "%" not in text and bool(ipaddress.IPv6Address(text))
            except ValueError:
                valid = False
            assert _full("ipv6", text) == valid, text


def _hostname_ok(text: str) -> bool:
    """RFC 1123 section 2.1 (the reference the subset must stay inside)."""
    labels = text.split(".")
    ldh = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?", re.ASCII)
    return len(text) <= 253 and all(len(x) <= 63 and ldh.fullmatch(x) for x in labels)


def test_hostname_pattern_is_a_subset() -> None:
    rng = random.Random(1)
    for _ in range(5000):
        n = rng.randrange(1, 10)
        labels = [
            "".join(rng.choice("ab-0.") for _ in range(rng.choice((1, 2, 4, 5, 30, 31, 63, 64))))
            for _ in range(n)
        ]
        text = ".".join(labels)
        if _full("hostname", text):
            assert _hostname_ok(text) and _rs_accepts("hostname", text), text
        elif _hostname_ok(text) and "--" not in {x[2:4] for x in labels}:
            # refused although valid: only outside the two documented shapes
            short = all(len(x) <= 30 for x in labels) and 4 <= n <= 8
            assert n > 3 and not short, text


def _near_misses(fmt: str, n: int, seed: int) -> list[str]:
    """The suite's strings for ``fmt`` and ``n`` random one- or two-character edits of them."""
    rng = random.Random(seed)
    base = sorted({data for _, data, _ in _instances(fmt)})
    alphabet = "0123456789aefzAFTZ:.-+/@[]%?#_ x"
    out = list(base)
    for _ in range(n):
        text = rng.choice(base)
        for _ in range(rng.randrange(1, 3)):
            i = rng.randrange(len(text) + 1)
            op = rng.randrange(3)
            ch = rng.choice(alphabet)
            if op == 0:
                text = text[:i] + ch + text[i:]
            elif op == 1:
                text = text[:i] + text[i + 1 :]
            else:
                text = text[:i] + ch + text[i + 1 :]
        out.append(text)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", sorted(FORMAT_PATTERNS))
def test_backends_compile_the_format_pattern_exactly(backend: str, fmt: str) -> None:
    """Each backend's grammar for the rewritten schema accepts exactly the strings that
    Python's ``re`` full-matches (the backends' regex dialects agree on these patterns), and
    ``jsonschema_rs`` accepts all of them."""
    c = Constraint.from_params(json_schema={"type": "string", "format": fmt})
    assert c is not None
    grammar = get_backend(backend)(BYTE_VOCAB).compile(c)
    for text in _near_misses(fmt, 150, seed=len(fmt)):
        want = _full(fmt, text)
        got = grammar_accepts(grammar.new_matcher(), json.dumps(text))
        assert got == want, f"{backend} {'accepts' if got else 'rejects'} {text!r}"
        if want:
            assert _rs_accepts(fmt, text), f"jsonschema_rs rejects {text!r}"


def _native_cases() -> list[tuple[str, str]]:
    return [(b, f) for b in BACKENDS for f in sorted(get_backend(b).schema_support.formats)]


@pytest.mark.parametrize(("backend", "fmt"), _native_cases())
def test_native_formats_reject_invalid_instances(backend: str, fmt: str) -> None:
    """A sibling ``pattern`` keeps the normalizer from rewriting ``format`` (one pattern per
    schema), so the backend's own format is compiled: each one a backend still claims must
    reject every invalid suite instance with a pattern beside it too (or strict mode refuses
    the pair)."""
    schema = {"type": "string", "format": fmt, "pattern": "^.*$"}
    c = Constraint.from_params(json_schema=schema)
    assert c is not None
    try:
        grammar = get_backend(backend)(BYTE_VOCAB).compile(c)
    except GrammarError as exc:  # strict mode: this backend drops one of the two
        assert "(with format)" in str(exc) or "(with pattern)" in str(exc), str(exc)
        return
    escaped = [
        f"{where}: {data!r}"
        for where, data, valid in _instances(fmt)
        if not valid
        and any(grammar_accepts(grammar.new_matcher(), s) for s in serializations(data, {}))
    ]
    assert not escaped, f"{backend} accepts invalid {fmt}:\n" + "\n".join(escaped)


def test_format_becomes_pattern_only_where_exact() -> None:
    date = {"type": "string", "format": "date", "title": "d"}
    assert normalize_schema(date) == {"type": "string", "pattern": FORMAT_PATTERNS["date"],
                                      "title": "d"}  # fmt: skip
    with_pattern = {"type": "string", "format": "date", "pattern": "^2"}
    assert normalize_schema(with_pattern) == with_pattern
    native = {"type": "string", "format": "duration"}
    assert normalize_schema(native) == native
    nested = {"type": "array", "items": {"type": "string", "format": "ipv4"}}
    assert normalize_schema(nested)["items"] == {
        "type": "string",
        "pattern": FORMAT_PATTERNS["ipv4"],
    }
