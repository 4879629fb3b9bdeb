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

import json
from dataclasses import dataclass, field
import jsonschema
import jsonschema_rs
import pytest
from grammar_helpers import BACKENDS, BYTE_VOCAB, grammar_accepts
from test_grammar_json_schema_suite import SUITE, serializations

from radixlm.runtime.grammar import Constraint, GrammarError, get_backend
from radixlm.runtime.grammar.formats import FORMAT_PATTERNS

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


def test_format_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the per backend x format table (README's figures) after the runs above."""
    if len(_TALLIES) < len(_cases()):
        pytest.skip("needs the format runs above")
    lines = [
        "Suite optional/format (string instances, drafts 2020-12 + 7), strict mode",
        f"{'backend':<11} {'format':<22} {'invalid rejected':>16} {'valid accepted':>16}",
    ]
    for (backend, fmt), t in sorted(_TALLIES.items()):
        if t.refused:
            lines.append(f"{backend:<11} {fmt:<22} {'refused':>16}")
            continue
        lines.append(
            f"{backend:<11} {fmt:<22} {f'{t.invalid_rejected}/{t.invalid}':>16} "
            f"{f'{t.valid_accepted}/{t.valid}':>16}"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
