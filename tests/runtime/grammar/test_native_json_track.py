"""The mypyc build of the verifier (``native``): the compiled scanner against its own Python
source (the same states and refusals for random JSON fed in random byte pieces, under schemas
whose checks refuse); a build is installed only for the sources it was built from, and a new
process imports every compiled module."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixlm.runtime.grammar as grammar_pkg
from radixlm.runtime.grammar import native
from radixlm.runtime.grammar.strict import verifier_schema_text
from radixlm.runtime.grammar.verifier import SchemaVerifier

NAME = "radixlm.runtime.grammar.json_track"
SOURCE = Path(native.__file__).with_name("json_track.py")


def _pure() -> ModuleType:
    """The Python source, loaded under another name (its own classes)."""
    spec = importlib.util.spec_from_file_location("_json_track_pure", SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiled() -> ModuleType:
    """The compiled module: the one imported when this process found a build, else imported
    from the build now (the process's own import is left as it was)."""
    directory = native.build()
    if directory is None:
        if native._mypy_version() is None:
            pytest.skip("mypy is not installed (the `grammar` extra installs it)")
        pytest.fail("mypyc could not compile json_track (see the log)")
    current = importlib.import_module(NAME)
    if native.compiled(current):
        return current
    ours = (NAME, f"{native.GROUP}__mypyc")
    saved = {k: sys.modules.pop(k) for k in ours if k in sys.modules}
    grammar_pkg.__path__.insert(0, str(directory))
    try:
        module = importlib.import_module(NAME)
    finally:
        grammar_pkg.__path__.remove(str(directory))
        for k in ours:
            sys.modules.pop(k, None)
        sys.modules.update(saved)
        grammar_pkg.json_track = saved[NAME]  # type: ignore[attr-defined]
    assert native.compiled(module)
    return module


PURE = _pure()
SCHEMAS = [
    {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}, "maxItems": 6},
    {"type": "object", "propertyNames": {"pattern": "^(?!id)[a-z]{1,6}$"}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?!te)[a-zé]*$"},
                                      "n": {"not": {"enum": [0, 1, "x"]}}}},
    {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}, {}]},
    {"type": "array", "items": {"type": "array", "uniqueItems": True}, "uniqueItems": True},
]  # fmt: skip
VERIFIERS = [SchemaVerifier.from_text(verifier_schema_text(json.dumps(s)) or "{}") for s in SCHEMAS]

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-20, 20),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(st.sampled_from('abtexidé"\\\n😀 7'), max_size=6),
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(st.sampled_from("abidnx"), max_size=3), inner, max_size=3)
    ),
    max_leaves=10,
)


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:]) if b > a]


def _same(a: Any, b: Any) -> bool:
    """The same state (tuples compare field by field) or the same refusing keyword."""
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return type(a).__name__ == type(b).__name__ and tuple(a) == tuple(b)


@pytest.fixture(scope="module")
def compiled() -> ModuleType:
    return _compiled()


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    value=_json,
    which=st.integers(0, len(SCHEMAS) - 1),
    indent=st.sampled_from([None, 1]),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_compiled_scanner_is_the_python_one(
    compiled: ModuleType, value: Any, which: int, indent: int | None, cuts: list[int]
) -> None:
    v = VERIFIERS[which]
    data = json.dumps(value, ensure_ascii=False, indent=indent).encode()
    mods = (compiled, PURE)
    states = [compiled.ScanState(), PURE.ScanState()]
    for piece in _pieces(data, cuts):
        seen = []
        for mod, state in zip(mods, states):
            refuser = mod.first_char_refuser(state, v)
            first = None if refuser is None else refuser(piece)
            seen.append((first, mod.open_checked(state, v), mod.ended(state)))
        assert seen[0] == seen[1]
        outs = [mod.advance_bytes(state, piece, v, v.root) for mod, state in zip(mods, states)]
        assert _same(*outs), (data, piece)
        if isinstance(outs[0], str):
            return
        states = outs
    ends = [mod.finish(state, v, v.root) for mod, state in zip(mods, states)]
    assert _same(*ends)
    # a value embedded in text: taken up to its end
    text = data.decode() + " tail"
    vals = [mod.advance_value(mod.ScanState(), text, v, v.root) for mod in mods]
    if isinstance(vals[0], str) or isinstance(vals[1], str):
        assert vals[0] == vals[1]
    else:
        assert _same(vals[0][0], vals[1][0]) and vals[0][1] == vals[1][1]


def test_install_puts_a_fresh_build_first_and_never_a_stale_one(
    compiled: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    path: list[str] = ["src"]
    assert native.install(path) and path[0] == str(native.build_dir())
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert not native.install(["src"])
    monkeypatch.delenv(native.PURE_ENV)
    monkeypatch.setattr(native, "build_key", lambda *a: "0" * 16)  # an edited source's key
    path = ["src"]
    assert not native.install(path) and path == ["src"]


def test_a_fresh_process_imports_every_compiled_module(compiled: ModuleType) -> None:
    """Built (the fixture builds if needed), a new process's imports are the extensions."""
    code = (
        "import importlib\n"
        f"print(*(importlib.import_module('{native.PACKAGE}.' + m).__file__ "
        f"for m in {native.MODULES!r}))"
    )
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    assert len(out) == len(native.MODULES) and all(f.endswith(".so") for f in out), out
