"""One writer per field of a `Request` (see its docstring): the scheduler package writes the
sequence and page state, the output processor the output state, the executor nothing.

Checked twice: statically (every write to a request field in the package, found in the AST, is
in its owner's modules) and dynamically (a real step through the executor leaves every request
field as it was)."""

from __future__ import annotations

import ast
import copy
import pathlib
import random

from fake_runner import EOS, FakeRunner, attach_core

import radixlm
from radixlm.config import SchedulerConfig
from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.request import OUTPUT_FIELDS, SEQUENCE_FIELDS, Request
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Scheduler, TokenAppender

PACKAGE = pathlib.Path(radixlm.__file__).parent
# Names that hold a Request wherever they are used in the package.
REQUEST_NAMES = {"req", "r", "request", "child", "parent", "branch", "b", "victim"}
OWNERS = {
    "sequence": ("runtime/scheduler/", "runtime/request.py"),
    "output": ("runtime/output_processor.py", "runtime/request.py"),
}
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove", "update", "appendleft"}


def _request_field_written(target: ast.expr) -> str | None:
    """The request field `target` writes (`req.f = ..`, `req.f[k] = ..`, `x.req.f = ..`)."""
    while isinstance(target, ast.Subscript):
        target = target.value
    if not isinstance(target, ast.Attribute):
        return None
    base = target.value
    is_request = (isinstance(base, ast.Name) and base.id in REQUEST_NAMES) or (
        isinstance(base, ast.Attribute) and base.attr == "req"
    )
    return target.attr if is_request else None


def writes(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [
                e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
            ]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            targets = [node.func.value]
        else:
            continue
        for t in targets:
            name = _request_field_written(t)
            if name is not None:
                yield node.lineno, name


def test_every_request_field_write_is_in_its_owner_module():
    bad, seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name in writes(ast.parse(path.read_text())):
            group = (
                "sequence"
                if name in SEQUENCE_FIELDS
                else "output"
                if name in OUTPUT_FIELDS
                else None
            )
            if group is None:
                continue
            seen.add(name)
            if not rel.startswith(OWNERS[group]):
                bad.append(f"{rel}:{line} writes {group} field {name!r}")
    assert not bad, "\n".join(bad)
    # The scan sees the writes it should: every group has writers it recognises.
    assert {"token_ids", "pages", "status"} <= seen and {"output_logprobs"} <= seen


def test_the_scan_catches_a_write_outside_the_owner():
    tree = ast.parse("def f(req):\n    req.token_ids.append(1)\n    x.req.pages = []\n")
    assert sorted(name for _, name in writes(tree)) == ["pages", "token_ids"]


def _fields(req: Request) -> dict:
    return {k: copy.deepcopy(v) for k, v in vars(req).items() if k not in ("grammar", "sink")}


def test_the_executor_changes_no_request():
    rng = random.Random(0)
    runner = FakeRunner(64, 4)
    pool = BlockPool(64, 4)
    s = Scheduler(pool, RadixCache(pool), SchedulerConfig(), TokenAppender(None, [EOS], 4096), 4096)
    s = attach_core(s, runner)
    reqs = [
        Request(
            f"r{i}",
            [rng.randrange(3, 60) for _ in range(9)],
            SamplingParams(max_new_tokens=4, temperature=0.8, seed=i, logprobs=True, n=2),
        )
        for i in range(3)
    ]
    for r in reqs:
        s.add_request(r)
    for _ in range(4):
        batch = s.schedule()
        before = [_fields(r) for r in batch.requests]
        out = s.executor.run(batch)
        assert [_fields(r) for r in batch.requests] == before
        s.processor.emit(s.update(batch, out))
