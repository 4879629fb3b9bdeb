"""JSON-schema coverage on real-world schemas (JSONSchemaBench): how many a grammar backend
accepts in strict mode, why it refuses the others, and how long accepted ones take to compile.

    .venv/bin/python benchmarks/bench_schema_coverage.py --data PATH/jsonschemabench/data
        [--subsets Glaiveai2K,Github_easy,...] [--per-subset 25] [--seed 0]
        [--backends xgrammar,outlines] [--timeout 10] [--out benchmarks/results/x.json]
    .venv/bin/python benchmarks/bench_schema_coverage.py --maskbench PATH/maskbench/data ...

Data: a local copy of the ``data/`` folder of ``guidance-ai/jsonschemabench`` on GitHub (one
schema per JSON file, a folder per subset). Its repository states no licence, so no schema is
vendored here: the script reads the copy named by ``--data``. The sample is fixed by the seed:
``--per-subset`` files from each subset, drawn with ``random.Random(seed)`` from its sorted file
list. The default subsets are the issue's development subsets; Kubernetes / JsonSchemaStore
are for an independent check (pass them with ``--subsets``).

With ``--maskbench`` the sample comes from the repository's ``maskbench/data`` folder instead
(files ``SUBSET---NAME.json`` holding a ``schema`` and ``tests``: instances, some invalid), and
every instance of an accepted schema is also walked byte by byte through the grammar (compact
JSON, in its own key order and in the schema's property order): an invalid instance (per
``jsonschema``) that the grammar accepts is counted as ``invalid_accepted`` (must be 0); valid
ones accepted are reported (over-strictness).

Per schema, in a worker process per backend on the default model's tokenizer (restarted when
a compile passes ``--timeout`` seconds, which counts as refused): ``Constraint.from_params``,
``backend.validate`` (metaschema + strict-mode check; the refusal reason is its first named
keyword) and ``backend.compile`` (timed; validate included). Only the public grammar API is
used, so the same script measures an older checkout: run it with ``PYTHONPATH`` set to that
checkout to get "before" figures. Timings are wall clock on whatever box runs this.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

DEV_SUBSETS = (
    "Glaiveai2K", "Github_trivial", "Github_easy", "Github_medium", "Github_hard",
    "Github_ultra", "Snowplow", "WashingtonPost",
)  # fmt: skip


@dataclass
class Outcome:
    subset: str
    file: str
    backend: str
    status: str  # "accepted" | "refused" | "timeout" | "invalid" (bad schema or not JSON)
    reason: str = ""
    compile_s: float = 0.0
    valid: int = 0  # instances (--maskbench): valid per jsonschema / accepted by the grammar
    valid_accepted: int = 0
    invalid: int = 0
    invalid_accepted: int = 0


def sample(data: Path, subsets: list[str], per_subset: int, seed: int) -> list[tuple[str, Path]]:
    rng = random.Random(seed)
    out = []
    for subset in subsets:
        files = sorted((data / subset).glob("*.json"))
        out += [(subset, f) for f in rng.sample(files, min(per_subset, len(files)))]
    return out


def sample_maskbench(
    data: Path, subsets: list[str], per_subset: int, seed: int
) -> list[tuple[str, Path]]:
    rng = random.Random(seed)
    out = []
    for subset in subsets:
        files = sorted(data.glob(f"{subset}---*.json"))
        out += [(subset, f) for f in rng.sample(files, min(per_subset, len(files)))]
    return out


def _property_order(schema: Any, order: dict[str, int]) -> dict[str, int]:
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict):
            for name in schema["properties"]:
                order.setdefault(name, len(order))
        for value in schema.values():
            _property_order(value, order)
    elif isinstance(schema, list):
        for value in schema:
            _property_order(value, order)
    return order


def _reordered(value: Any, order: dict[str, int]) -> Any:
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: (order.get(k, len(order)), list(value).index(k)))
        return {k: _reordered(value[k], order) for k in keys}
    if isinstance(value, list):
        return [_reordered(v, order) for v in value]
    return value


def _walk_bytes(compiled: Any, text: str) -> bool | None:
    """The grammar accepts ``text`` then EOS (one single-byte token per byte); None when the
    vocabulary has no token for one of its bytes."""
    m = compiled.new_matcher()
    single = m.vocab.single_byte_ids
    data = text.encode()
    if any(single[b] is None for b in data):
        return None
    for b in data:
        if not m.accept_token(single[b]):
            return False
    return m.is_completed()


def check_instances(compiled: Any, schema: Any, tests: list[dict[str, Any]]) -> list[int]:
    """[valid, valid accepted, invalid, invalid accepted] over ``tests``."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema)
    order = _property_order(schema, {})
    counts = [0, 0, 0, 0]
    for test in tests:
        data = test["data"]
        try:
            valid = validator.is_valid(data)
        except Exception:  # unresolvable reference etc.: no verdict
            continue
        texts = {json.dumps(v, separators=(",", ":"), ensure_ascii=False)
                 for v in (data, _reordered(data, order))}  # fmt: skip
        walks = [_walk_bytes(compiled, t) for t in texts]
        if None in walks:
            continue
        accepted = any(walks)
        base = 0 if valid else 2
        counts[base] += 1
        counts[base + 1] += accepted
    return counts


def _reason(message: str) -> str:
    """The first keyword a refusal names (``... cannot enforce: KEYWORD (at #/...)``)."""
    m = re.search(r"cannot enforce: (.+?) \(at ", message)
    if m:
        return re.split(r"[ :(]", m.group(1).strip())[0]
    if "invalid JSON schema" in message:
        return "invalid schema (metaschema)"
    return message.split(":")[0][:60]


def _worker(conn: Connection, backend_name: str) -> None:
    from radixlm.runtime.grammar import Constraint, GrammarError, TokenVocab, get_backend
    from radixlm.runtime.models.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    vocab = TokenVocab.from_tokenizer(tokenizer, 49152, [tokenizer.eos_token_id])
    backend = get_backend(backend_name)(vocab)
    conn.send("ready")
    while True:
        request = conn.recv()
        if request is None:
            return
        text, tests = request
        start = time.perf_counter()
        try:
            c = Constraint.from_params(json_schema=text)
        except GrammarError as exc:
            conn.send(("invalid", str(exc)[:300], 0.0, []))
            continue
        try:
            assert c is not None
            backend.validate(c)
            compiled = backend.compile(c)
        except GrammarError as exc:
            conn.send(("refused", str(exc)[:2000], 0.0, []))
            continue
        elapsed = time.perf_counter() - start
        counts = check_instances(compiled, json.loads(text), tests) if tests else []
        conn.send(("accepted", "", elapsed, counts))


class Worker:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, self.backend), daemon=True)
        self.proc.start()
        assert self.conn.recv() == "ready"

    def run(self, text: str, tests: list[Any], timeout: float) -> tuple[str, str, float, list[int]]:
        self.conn.send((text, tests))
        if self.conn.poll(timeout):
            return self.conn.recv()
        self.proc.kill()
        self.proc.join()
        self._start()
        return ("timeout", f"compile > {timeout:g} s", timeout, [])

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    keys = sorted({(o.backend, o.subset) for o in outcomes}) + sorted(
        {(o.backend, "ALL") for o in outcomes}
    )
    for backend, subset in keys:
        rows = [o for o in outcomes if o.backend == backend and subset in ("ALL", o.subset)]
        times = [o.compile_s for o in rows if o.status == "accepted"]
        table[f"{backend}/{subset}"] = {
            "n": len(rows),
            "accepted_pct": 100.0 * len(times) / len(rows),
            "compile_p50_s": statistics.median(times) if times else float("nan"),
            "compile_p99_s": _pct(times, 0.99),
            "compile_max_s": max(times, default=float("nan")),
            "over_1s": sum(t > 1.0 for t in times),
            "timeouts": sum(o.status == "timeout" for o in rows),
            "valid": sum(o.valid for o in rows),
            "valid_accepted": sum(o.valid_accepted for o in rows),
            "invalid": sum(o.invalid for o in rows),
            "invalid_accepted": sum(o.invalid_accepted for o in rows),
            "refusals": Counter(o.reason for o in rows if o.status != "accepted").most_common(12),
        }
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--data", type=Path, help="jsonschemabench's data/ folder")
    where.add_argument("--maskbench", type=Path, help="jsonschemabench's maskbench/data/ folder")
    ap.add_argument("--subsets", default=",".join(DEV_SUBSETS))
    ap.add_argument("--per-subset", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default="xgrammar,outlines")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    subsets = args.subsets.split(",")
    if args.maskbench:
        picked = sample_maskbench(args.maskbench, subsets, args.per_subset, args.seed)
    else:
        picked = sample(args.data, subsets, args.per_subset, args.seed)
    outcomes: list[Outcome] = []
    for backend in args.backends.split(","):
        worker = Worker(backend)
        for subset, path in picked:
            text, tests = path.read_text(), []
            if args.maskbench:
                entry = json.loads(text)
                text, tests = json.dumps(entry["schema"]), entry.get("tests", [])
            status, message, seconds, counts = worker.run(text, tests, args.timeout)
            reason = "" if status == "accepted" else _reason(message)
            o = Outcome(subset, path.name, backend, status, reason, seconds)
            if counts:
                o.valid, o.valid_accepted, o.invalid, o.invalid_accepted = counts
            outcomes.append(o)
            print(f"{backend} {len(outcomes)}/{len(picked)} {subset}/{path.name}: {status} "
                  f"{reason} {seconds:.3f}s", file=sys.stderr, flush=True)  # fmt: skip
        worker.close()
    table = summarize(outcomes)
    print(f"{'backend/subset':<28} {'n':>4} {'accepted':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'max ms':>8} {'>1s':>4} {'t/o':>4} {'valid acc':>11} {'invalid acc':>11}")  # fmt: skip
    for key, row in table.items():
        valid = f"{row['valid_accepted']}/{row['valid']}"
        invalid = f"{row['invalid_accepted']}/{row['invalid']}"
        print(
            f"{key:<28} {row['n']:>4} {row['accepted_pct']:>8.1f}% "
            f"{1e3 * row['compile_p50_s']:>8.1f} {1e3 * row['compile_p99_s']:>8.1f} "
            f"{1e3 * row['compile_max_s']:>8.1f} {row['over_1s']:>4} {row['timeouts']:>4} "
            f"{valid:>11} {invalid:>11}"
        )
    for key, row in table.items():
        if key.endswith("/ALL"):
            print(f"refused by {key}: " + ", ".join(f"{r} {n}" for r, n in row["refusals"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "table": table,
                  "outcomes": [asdict(o) for o in outcomes]}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
