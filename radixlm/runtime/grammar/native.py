"""The verifier (its scanner, trackers, checks and matcher) compiled to C with mypyc, loaded
in place of its Python source.

``json_track``, ``trackers``, ``verifier`` and ``verified`` run for every token a verified
request samples (and for every candidate a resample checks), on the step thread right after a
forward, where Python code runs 3-5x slower than in a warm loop (the forward streams the weights
through every cache level). Compiled, they run from far fewer cache lines. The source stays the
one implementation: ``build()`` compiles those same files with mypyc (mypy reading the types of
the radixlm modules they import; ``verified``'s classes extend ``base``'s Python classes) into
``<cache>/mypyc/<key>/`` and ``install()`` (run by this package's ``__init__``) puts that folder
first on the package's ``__path__``, so ``import radixlm.runtime.grammar.json_track`` (and the
others) find the extensions there.

Invariants: ``<key>`` hashes this package's sources, ``tool_calls.py``, the Python version and
mypy's version, so a stale build is never loaded (an edited source is simply not compiled until
built again); a missing build, a failed build or ``RADIXLM_PURE_PYTHON=1`` leaves the pure
Python modules, which behave the same (``tests/runtime/grammar/test_native_json_track.py``
compares the scanners; compiled code also checks the annotated types at run time, so a wrong
annotation fails loudly).
``main()`` builds (``scripts/setup.sh`` runs it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "radixlm.runtime.grammar"
MODULES = ("json_track", "trackers", "verifier", "verified")  # compiled together
GROUP = f"{PACKAGE}.verifier_native"  # their shared library: ``verifier_native__mypyc``
_SOURCE_DIR = Path(__file__).resolve().parent
PURE_ENV = "RADIXLM_PURE_PYTHON"


def _mypy_version() -> str | None:
    """The installed mypy's version file (its text; found, not imported: importing mypy loads
    its own compiled library, ~20 ms at every start), or None without mypy."""
    from importlib.util import find_spec

    spec = find_spec("mypy")
    if spec is None or spec.origin is None:
        return None
    try:
        return (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None


def _key_sources() -> list[Path]:
    """What the build depends on: the grammar package's sources (the compiled modules and
    those they import, whose types mypy reads) and ``tool_calls.py`` (imported by them)."""
    return [*sorted(_SOURCE_DIR.glob("*.py")), _SOURCE_DIR.parents[1] / "tool_calls.py"]


def build_key(mypy_version: str | None = None) -> str:
    """Hash of the sources the build depends on, the Python version and mypy's version."""
    h = hashlib.sha256()
    for path in _key_sources():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(sys.version.encode())
    h.update((mypy_version or _mypy_version() or "").encode())
    return h.hexdigest()[:16]


def build_dir(key: str | None = None) -> Path:
    from radixlm.kernels.cpu.build import cache_root

    return cache_root() / "mypyc" / (key or build_key())


def _built(directory: Path) -> bool:
    names = (*MODULES, GROUP.rsplit(".", 1)[1] + "__mypyc")
    return all(any(directory.glob(f"{name}.*.so")) for name in names)


def build(verbose: bool = False) -> Path | None:
    """Compile ``MODULES`` (if not built for this key); their folder, or None (logged) when
    mypy is not installed or the compile fails."""
    version = _mypy_version()
    if version is None:
        logger.warning("mypy is not installed: the verifier's modules stay pure Python")
        return None
    directory = build_dir(build_key(version))
    if _built(directory):
        return directory
    with tempfile.TemporaryDirectory(prefix="radixlm-mypyc-") as tmp:
        # The whole package's sources, so that mypy reads the types the modules import
        # (``verified``'s classes extend ``base``'s Python classes: mypyc must know them).
        root = _SOURCE_DIR.parents[2]  # holds radixlm/
        for src in (root / "radixlm").rglob("*.py"):
            dest = Path(tmp) / src.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest)
        package = Path(tmp).joinpath(*PACKAGE.split("."))
        paths = [str(Path(*PACKAGE.split("."), f"{name}.py")) for name in MODULES]
        # radixlm's modules are read, third-party ones are not (typed Any: plain calls).
        (Path(tmp) / "mypy.ini").write_text(
            "[mypy]\nfollow_imports = skip\nignore_missing_imports = True\n"
            "[mypy-radixlm.*]\nfollow_imports = silent\n"
        )
        # One group library, named inside the package (a default group's name is top level).
        setup = (
            "from setuptools import setup\n"
            "from mypyc.build import mypycify\n"
            f"paths = {paths!r} + ['--config-file=mypy.ini']\n"
            f"setup(name='radixlm-native', ext_modules=mypycify(paths, group_name={GROUP!r}))\n"
        )
        (Path(tmp) / "setup.py").write_text(setup)
        cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if verbose or proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
        if proc.returncode != 0:
            logger.warning("mypyc failed (%d): the verifier stays pure Python", proc.returncode)
            return None
        staging = Path(tempfile.mkdtemp(prefix="staging-", dir=tmp))
        for so in package.glob("*.so"):  # each module's shim and the group's library
            shutil.copy(so, staging / so.name)
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            staging.rename(directory)  # atomic: a concurrent build loses the race, harmlessly
        except OSError:
            if not _built(directory):
                raise
    return directory


def install(package_path: list[str]) -> bool:
    """Put this source's compiled build first on ``package_path`` (the package's ``__path__``)
    when there is one; True when it did. Reads the sources' hash only (no compile)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return False
    try:
        directory = build_dir()
    except Exception:  # noqa: BLE001 - no cache dir, unreadable source: stay pure Python
        return False
    if not _built(directory):
        return False
    if str(directory) not in package_path:
        package_path.insert(0, str(directory))
    return True


def compiled(module: object) -> bool:
    """``module`` was loaded from a compiled build."""
    return str(getattr(module, "__file__", "")).endswith(".so")


def main() -> None:
    """Build, printing where (``python -c "from radixlm.runtime.grammar.native import main;
    main()"``: not ``-m``, as this package's ``__init__`` imports this module)."""
    logging.basicConfig(level=logging.INFO)
    try:
        out = build(verbose="-v" in sys.argv)
    except Exception as exc:  # noqa: BLE001 - setup goes on: the pure Python module works
        logger.warning("could not build the compiled verifier: %r", exc)
        out = None
    print(f"compiled verifier: {out}" if out else "compiled verifier: not built")
