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

Held out for issue 26 (chosen before any run of the verifier, never looked at or tuned on):
the maskbench subsets ``MCPspec`` and ``Handwritten`` (``HELD_OUT_SUBSETS``; run them with
``--maskbench PATH --subsets MCPspec,Handwritten``).

With ``--maskbench`` the sample comes from the repository's ``maskbench/data`` folder instead
(files ``SUBSET---NAME.json`` holding a ``schema`` and ``tests``: instances, some invalid), and
every instance of an accepted schema is also walked byte by byte through the grammar (compact
JSON, in its own key order and in the schema's property order): an invalid instance (per
``jsonschema``) that the grammar accepts is counted as ``invalid_accepted`` (must be 0); valid
ones accepted are reported (over-strictness).

With ``--as-tool`` each schema is compiled as the ``parameters`` of one tool (a ``tool_calls``
constraint, required mode) and its instances are walked as that tool's call: the tool path's
coverage, through the same normalization, relaxation and verifier.

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
# Chosen for issue 26 before its first run; Kubernetes / JsonSchemaStore stay reserved.
HELD_OUT_SUBSETS = ("MCPspec", "Handwritten")


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


def check_instances(
    compiled: Any, schema: Any, tests: list[dict[str, Any]], as_tool: bool = False
) -> list[int]:
    """[valid, valid accepted, invalid, invalid accepted] over ``tests`` (``as_tool``: each
    instance as the arguments of one call of tool ``f``)."""
    import jsonschema

    from radixlm.tool_calls import format_tool_call

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
        walks = [_walk_bytes(compiled, format_tool_call("f", t) if as_tool else t) for t in texts]
        if None in walks:
            continue
        accepted = any(walks)
        base = 0 if valid else 2
        counts[base] += 1
        counts[base + 1] += accepted
    return counts


def _reason(message: str) -> str:
    """The first keyword a refusal names (``... cannot enforce: KEYWORD (at #/...)``); for the
    auto backend, the first backend's reason."""
    if message.startswith("no grammar backend"):
        message = message.split(": ", 2)[-1]
    if message.startswith("invalid json_schema: "):
        return message.removeprefix("invalid json_schema: ")[:50]
    m = re.search(r"cannot enforce: (.+?) \(at ", message)
    if m:
        return re.split(r"[ :(]", m.group(1).strip())[0]
    if "invalid JSON schema" in message:
        return "invalid schema (metaschema)"
    return message.split(":")[0][:60]


def _worker(conn: Connection, backend_name: str, as_tool: bool) -> None:
    from radixlm.runtime.grammar.base import get_backend
    from radixlm.runtime.grammar.constraint import Constraint
    from radixlm.runtime.grammar.errors import GrammarError
    from radixlm.runtime.grammar.vocab import TokenVocab
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
            if as_tool:  # the schema as a tool's parameters: the tool_calls path
                tool = {"name": "f", "parameters": json.loads(text)}
                c = Constraint.from_params(tool_calls={"mode": "required", "tools": [tool]})
            else:
                c = Constraint.from_params(json_schema=text)
        except (GrammarError, ValueError) as exc:
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
        schema = json.loads(text)
        counts = check_instances(compiled, schema, tests, as_tool) if tests else []
        conn.send(("accepted", "", elapsed, counts))


class Worker:
    def __init__(self, backend: str, as_tool: bool = False) -> None:
        self.backend = backend
        self.as_tool = as_tool
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker, args=(child, self.backend, self.as_tool), daemon=True
        )
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


@dataclass
class Generation:
    subset: str
    file: str
    status: str  # "valid" | "cut" (finished by max_tokens) | "invalid" | "error"
    detail: str = ""


def generate(
    picked: list[tuple[str, Path]],
    accepted: set[str],
    per_subset: int,
    max_tokens: int,
    repeat: int = 1,
) -> list[Generation]:
    """On the default model (engine defaults: the ``auto`` grammar backend, strict mode),
    ``repeat`` sampled generations per accepted schema (``per_subset`` of each subset, one
    batch): each output is parsed and validated with ``jsonschema`` and its format checker."""
    import jsonschema

    from radixlm import Engine, SamplingParams

    chosen: list[tuple[str, Path]] = []
    for subset in dict.fromkeys(s for s, _ in picked):
        files = [(s, p) for s, p in picked if s == subset and f"{s}/{p.name}" in accepted]
        chosen += files[:per_subset]
    chosen = [c for c in chosen for _ in range(repeat)]
    engine = Engine(None, num_threads=2)
    try:
        prompts, params = [], []
        for i, (_, path) in enumerate(chosen):
            text = path.read_text()
            shown = text if len(text) <= 3000 else text[:3000] + " ..."
            ask = f"Write one JSON value that matches this JSON schema:\n{shown}"
            prompts.append(engine.apply_chat_template([{"role": "user", "content": ask}]))
            params.append(SamplingParams(max_new_tokens=max_tokens, temperature=0.7, seed=i,
                                         constraint={"json_schema": text}))  # fmt: skip
        results = engine.generate(prompts, params)
        # Per keyword of the verifier: refused samples (masked), redraws, dead ends.
        print("verifier events:", json.dumps(engine.stats().verifier_events, sort_keys=True))
    finally:
        engine.shutdown()
    out = []
    for (subset, path), r in zip(chosen, results):
        schema = json.loads(path.read_text())
        if r.error is not None:
            out.append(Generation(subset, path.name, "error", str(r.error)[:200]))
            continue
        if r.finish_reason == "length":
            out.append(Generation(subset, path.name, "cut"))
            continue
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            errors = list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(
                json.loads(r.text)))  # fmt: skip
        except ValueError as exc:  # not JSON at all
            errors = [exc]
        detail = "; ".join(str(getattr(e, "message", e))[:100] for e in errors[:2])
        out.append(Generation(subset, path.name, "invalid" if errors else "valid", detail))
    return out


def generation_table(gens: list[Generation]) -> dict[str, dict[str, float]]:
    table = {}
    for subset in [*dict.fromkeys(g.subset for g in gens), "ALL"]:
        rows = [g for g in gens if subset in ("ALL", g.subset)]
        counts = Counter(g.status for g in rows)
        table[subset] = {"n": len(rows), **{k: counts.get(k, 0) for k in
                                            ("valid", "cut", "invalid", "error")}}  # fmt: skip
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--data", type=Path, help="jsonschemabench's data/ folder")
    where.add_argument("--maskbench", type=Path, help="jsonschemabench's maskbench/data/ folder")
    ap.add_argument("--subsets", default=",".join(DEV_SUBSETS))
    ap.add_argument("--per-subset", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default="auto,llguidance,xgrammar,outlines")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument(
        "--as-tool",
        action="store_true",
        help="compile each schema as a tool's parameters (tool_calls constraint)",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="also generate on the default model for N accepted schemas per subset "
                    "(those the first backend of --backends accepted)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--files", help="SUBSET/FILE,... : these schemas instead of the sample")
    ap.add_argument("--repeat", type=int, default=1,
                    help="generations per chosen schema (sampling seeds 0..N-1)")  # fmt: skip
    args = ap.parse_args()

    subsets = args.subsets.split(",")
    if args.files:
        picked = [(f.split("/")[0], args.data / f) for f in args.files.split(",")]
    elif args.maskbench:
        picked = sample_maskbench(args.maskbench, subsets, args.per_subset, args.seed)
    else:
        picked = sample(args.data, subsets, args.per_subset, args.seed)
    outcomes: list[Outcome] = []
    for backend in args.backends.split(","):
        worker = Worker(backend, args.as_tool)
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
    gens: list[Generation] = []
    if args.generate:
        first = args.backends.split(",")[0]
        accepted = {f"{o.subset}/{o.file}" for o in outcomes
                    if o.backend == first and o.status == "accepted"}  # fmt: skip
        gens = generate(picked, accepted, args.generate, args.max_tokens, args.repeat)
        print(f"\ngeneration ({first} accepted, default model, temperature 0.7, "
              f"max_tokens {args.max_tokens}):")  # fmt: skip
        print(f"{'subset':<16} {'n':>4} {'valid':>7} {'cut':>7} {'invalid':>7} {'error':>6}")
        for subset, row in generation_table(gens).items():
            n = max(row["n"], 1)
            valid, cut = 100 * row["valid"] / n, 100 * row["cut"] / n
            print(f"{subset:<16} {row['n']:>4} {valid:>6.1f}% {cut:>6.1f}% "
                  f"{row['invalid']:>7} {row['error']:>6}")  # fmt: skip
        for g in gens:
            if g.status in ("invalid", "error"):
                print(f"  {g.status}: {g.subset}/{g.file}: {g.detail}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "table": table,
                  "outcomes": [asdict(o) for o in outcomes],
                  "generation": generation_table(gens) if gens else {},
                  "generations": [asdict(g) for g in gens]}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
