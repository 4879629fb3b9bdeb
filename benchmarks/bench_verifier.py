"""Generation under schemas that need the verifier, on the real default model: is every output
valid, and what does the checker do and cost, per keyword.

    .venv/bin/python benchmarks/bench_verifier.py [--samples 8] [--max-tokens 160]
        [--temperature 0.8] [--keywords uniqueItems,not,...] [--maskbench PATH --real 20]
        [--no-dead-ends] [--random 200] [--batch 8] [--dtype bfloat16] [--threads 2]
        [--backend auto] [--out benchmarks/results/verifier.json] [--smoke]

Groups: one per keyword the grammar cannot express (``KEYWORD_SCHEMAS``: small schemas a
135M model can fill, each needing the verifier for that keyword), ``tools`` (the same keywords
in a tool's ``parameters``, through the ``tool_calls`` constraint), ``dead_ends`` (unless
``--no-dead-ends``: ``DEAD_END_SCHEMAS``, whose grammar-legal prefixes often have no valid
completion, e.g. ``"a`` once ``ab``, ``ac``, ``ad`` are used: the rollback's work), and with
``--maskbench``
``real``: up to ``--real`` schemas of jsonschemabench's maskbench folder (sorted names, every
subset but the reserved Kubernetes / JsonSchemaStore) that compile strictly and need the
verifier (``strict.verified_keywords``), and with ``--random N`` ``random``: the schemas of
``random_schemas.random_schema`` for seeds 0..N-1 that need the verifier and compile strictly
(one generation each, even seeds greedy, odd ones sampled; the rest are counted as left out).
Each group runs ``--samples`` sampled generations per schema (seeds 0..N-1) in batches of
``--batch`` requests on one engine (``--backend``, ``auto`` by default; strict mode).

Per generation: ``valid`` (finished, parses, validates with ``jsonschema`` and its format
checker: the reference, never a hand-written check), ``cut`` (``max_tokens`` reached),
``dead_end`` (the request ended with ``grammar_dead_end``: every continuation refused),
``invalid`` (finished but ``jsonschema`` rejects it: must be 0) or ``error`` (anything else).

Per group, from the engine's grammar step (counters read before and after the batch): the
verifier's events per keyword (``masked``: sampled tokens refused and masked, ``resampled``:
redraws, ``dead_ends``: rows left with no token, ``rollbacks``: dead ends left by rolling the
request back a token and banning it there; the rest end as ``dead_end``), the seconds spent
checking sampled tokens (``verifier_s``) and in the whole grammar step (masks, accept,
jump-forward, checks: ``grammar_s``), per generated token (``verifier_us_per_token``) and as a
share of the batch's wall time; and, per decode step (no item still in its prompt; ``StepMeter``
on the step thread), the grammar step's and the checker's seconds over the forward's
(``g/fwd``, ``v/fwd``: what holds up the step; ``o/fwd``: the mask fills done on the worker
while the forward ran). The step ratios are measured in the same run on the same thread, so
they hardly depend on the box's load; use ``--threads 1`` for them (the worker then has the
other core).
``--smoke``: two schemas, two samples, 48 tokens (a check that the script runs, nothing to
report).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jsonschema

from radixlm import Engine, SamplingParams
from radixlm.runtime.grammar.strict import verified_keywords
from radixlm.tool_calls import parse_tool_calls

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_schemas import random_schema  # noqa: E402

KEYWORD_SCHEMAS: dict[str, dict[str, Any]] = {
    "uniqueItems": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                "uniqueItems": True, "minItems": 3, "maxItems": 5}},
        "required": ["tags"], "additionalProperties": False,
    },
    "not": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99,
                             "not": {"enum": [0, 1, 7, 10, 42]}},
                       "word": {"type": "string", "maxLength": 12, "not": {"const": "hello"}}},
        "required": ["n", "word"], "additionalProperties": False,
    },
    "propertyNames": {
        # a lookahead: the grammar takes ^[a-z]{2,6}$ (a map's anchored name pattern is the
        # grammar's, exactly: ``relax``), the verifier the rest
        "type": "object", "propertyNames": {"pattern": "^(?!id)[a-z]{2,6}$"},
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "minProperties": 2, "maxProperties": 4,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^(?!test)[a-z]{3,8}$"}},
        "required": ["code"], "additionalProperties": False,
    },
    "if": {
        "type": "object",
        "properties": {"kind": {"enum": ["small", "large"]},
                       "size": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["kind", "size"], "additionalProperties": False,
        "if": {"properties": {"size": {"minimum": 50}}},
        "then": {"properties": {"kind": {"const": "large"}}},
        "else": {"properties": {"kind": {"const": "small"}}},
    },
    "oneOf": {
        "type": "object",
        "properties": {"v": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 50},
                                       {"type": "integer", "minimum": 20, "maximum": 90}]}},
        "required": ["v"], "additionalProperties": False,
    },
    "contains": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "contains": {"const": 7}, "minItems": 2, "maxItems": 6,
    },
    "unevaluatedProperties": {
        "type": "object",
        "allOf": [{"properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}}}],
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["id", "name"], "unevaluatedProperties": False,
    },
}  # fmt: skip
# Schemas with grammar-legal prefixes that no valid instance continues (the rollback's work):
# group ``dead_ends``. name -> (schema, a valid instance).
DEAD_END_SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "unique_codes": ({
        "type": "object",
        "properties": {"codes": {"type": "array", "minItems": 3, "maxItems": 4,
                                 "items": {"type": "string", "pattern": "^(ab|ac|ad|b)$"},
                                 "uniqueItems": True}},
        "required": ["codes"], "additionalProperties": False,
    }, {"codes": ["ab", "ac", "b"]}),
    "not_range": ({
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 100, "maximum": 999,
                             "not": {"minimum": 110, "maximum": 989}}},
        "required": ["n"], "additionalProperties": False,
    }, {"n": 105}),
}  # fmt: skip
RESERVED = ("Kubernetes", "JsonSchemaStore")  # issue 26: kept for independent checks


@dataclass
class Case:
    group: str
    name: str
    schema: Any  # the arguments' schema for the tools group
    tool: bool = False
    greedy: bool = False  # temperature 0 (else ``--temperature``)


@dataclass
class Outcome:
    group: str
    name: str
    seed: int
    status: str  # valid | cut | dead_end | invalid | error
    tokens: int
    detail: str = ""


def keyword_cases(keywords: list[str]) -> list[Case]:
    cases = [Case(k, k, KEYWORD_SCHEMAS[k]) for k in keywords]
    for k in keywords[:3]:  # the same keywords in a tool's parameters
        if KEYWORD_SCHEMAS[k].get("type") == "object":
            cases.append(Case("tools", k, KEYWORD_SCHEMAS[k], tool=True))
    return cases


def dead_end_cases() -> list[Case]:
    return [Case("dead_ends", name, schema) for name, (schema, _) in DEAD_END_SCHEMAS.items()]


def _strict_backend() -> Any:
    """The default (``auto``) backend over the default model's vocabulary."""
    from radixlm.runtime.grammar.base import get_backend
    from radixlm.runtime.grammar.vocab import TokenVocab
    from radixlm.runtime.models.loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(None))
    vocab = TokenVocab.from_tokenizer(tok, len(tok), [tok.eos_token_id])
    return get_backend("auto")(vocab)


def _needs_verifier(backend: Any, schema: Any) -> bool:
    """``schema`` compiles strictly and needs the verifier."""
    from radixlm.runtime.grammar.constraint import Constraint
    from radixlm.runtime.grammar.errors import GrammarError

    try:
        c = Constraint.from_params(json_schema=schema)
        if c is None or not verified_keywords(c.spec):
            return False
        backend.validate(c)
        backend.compile(c)
    except (GrammarError, ValueError):
        return False
    return True


def real_cases(folder: Path, limit: int) -> list[Case]:
    """Maskbench schemas that need the verifier and compile strictly (sorted, first ``limit``)."""
    backend = _strict_backend()
    out: list[Case] = []
    for path in sorted(folder.glob("*.json")):
        if path.name.split("---")[0] in RESERVED or len(out) >= limit:
            continue
        schema = json.loads(path.read_text()).get("schema")
        if _needs_verifier(backend, schema):
            out.append(Case("real", path.stem, schema))
    return out


def random_cases(count: int) -> tuple[list[Case], int]:
    """``random_schemas.random_schema`` of seeds 0..count-1 that need the verifier and compile
    strictly (even seeds greedy, odd ones sampled); also how many were left out."""
    backend = _strict_backend()
    out = []
    for seed in range(count):
        schema = random_schema(random.Random(seed))
        if _needs_verifier(backend, schema):
            out.append(Case("random", f"seed{seed}", schema, greedy=seed % 2 == 0))
    return out, count - len(out)


def _validates(schema: Any, value: Any) -> list[str]:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    errors = cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)
    return [e.message[:120] for e in errors]


def judge(case: Case, seed: int, result: Any) -> Outcome:
    out = result.outputs[0]
    n = len(out.output_token_ids)
    if out.finish_reason == "error":
        status = "dead_end" if out.error_code == "grammar_dead_end" else "error"
        return Outcome(case.group, case.name, seed, status, n, str(out.error)[:160])
    if out.finish_reason == "length":
        return Outcome(case.group, case.name, seed, "cut", n)
    try:
        if case.tool:
            calls = parse_tool_calls(out.text).calls
            errors = [m for c in calls for m in _validates(case.schema, c.args)]
            errors += [] if calls else ["no tool call"]
        else:
            errors = _validates(case.schema, json.loads(out.text))
    except ValueError as exc:  # not JSON
        errors = [f"not JSON: {exc}"[:120]]
    return Outcome(case.group, case.name, seed, "invalid" if errors else "valid", n,
                   "; ".join(errors[:2]))  # fmt: skip


def params_for(case: Case, seed: int, args: argparse.Namespace) -> SamplingParams:
    if case.tool:
        spec = {"mode": "required", "parallel": False,
                "tools": [{"name": "record", "parameters": case.schema}]}  # fmt: skip
        constraint: dict[str, Any] = {"tool_calls": spec}
    else:
        constraint = {"json_schema": case.schema}
    temperature = 0.0 if case.greedy else args.temperature
    return SamplingParams(max_new_tokens=args.max_tokens, temperature=temperature,
                          seed=seed, constraint=constraint)  # fmt: skip


def prompt_for(engine: Engine, case: Case) -> str:
    if case.tool:
        ask = ("Call the function record with arguments matching this JSON schema:\n"
               + json.dumps(case.schema))  # fmt: skip
    else:
        ask = "Write one JSON value that matches this JSON schema:\n" + json.dumps(case.schema)
    return engine.apply_chat_template([{"role": "user", "content": ask[:4000]}])


def _counters(engine: Engine) -> tuple[float, float, dict[str, dict[str, int]]]:
    step = engine.scheduler.appender.grammar
    if step is None:
        return 0.0, 0.0, {}
    return step.seconds, step.verifier_seconds, step.verifier_events()


def _delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict:
    out = {}
    for k, row in after.items():
        d = {e: n - before.get(k, {}).get(e, 0) for e, n in row.items()}
        if any(d.values()):
            out[k] = d
    return out


class StepMeter:
    """Per engine step, in the step thread: the forward's seconds (``StepOutput``) and the
    grammar step's seconds (masks, checks, accept, jump-forward) from this step's start to
    the next's (so the update's ``advance`` counts with the step it follows). Decode steps
    (no item still in its prompt) are kept apart: their grammar / forward ratio, measured on the
    same thread in the same run, does not depend on the box's load."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # decode, rows, forward s, then grammar / checker / overlapped mask-fill s
        self.steps: list[tuple[bool, int, float, float, float, float]] = []
        self._open: tuple[bool, int, float, float, float, float] | None = None
        run = engine.executor.run

        def metered(batch: Any) -> Any:
            self._close()
            g, v, o = self._grammar()
            # Decoding (after a jump-forward an item computes its forced tokens too): no item
            # is still in its prompt.
            decode = bool(batch.items) and all(
                i.req.num_computed_tokens >= i.req.num_prompt_tokens for i in batch.items
            )
            out = run(batch)
            self._open = (decode, len(batch.items), out.forward_seconds, g, v, o)
            return out

        engine.executor.run = metered

    def _grammar(self) -> tuple[float, float, float]:
        step = self.engine.scheduler.appender.grammar
        if step is None:
            return 0.0, 0.0, 0.0
        return step.seconds, step.verifier_seconds, step.overlapped_seconds

    def _close(self) -> None:
        if self._open is not None:
            decode, rows, fwd, g0, v0, o0 = self._open
            g1, v1, o1 = self._grammar()
            self.steps.append((decode, rows, fwd, g1 - g0, v1 - v0, o1 - o0))
            self._open = None

    def take(self) -> dict[str, float]:
        """The decode steps since the last ``take``: their count, mean rows, and grammar /
        checker seconds (on the step thread) and the mask fills overlapped with the forward
        (on the worker) as a share of their forward seconds."""
        self._close()
        decode = [s for s in self.steps if s[0]]
        self.steps = []
        fwd = sum(s[2] for s in decode) or float("nan")
        return {
            "decode_steps": len(decode),
            "decode_rows": sum(s[1] for s in decode) / max(len(decode), 1),
            "decode_forward_s": sum(s[2] for s in decode),
            "decode_grammar_share": sum(s[3] for s in decode) / fwd,
            "decode_verifier_share": sum(s[4] for s in decode) / fwd,
            "decode_overlapped_share": sum(s[5] for s in decode) / fwd,
        }


def run_group(
    engine: Engine, meter: StepMeter, group: str, cases: list[Case], args: argparse.Namespace
) -> dict:
    jobs = [(c, s) for c in cases for s in range(args.samples if group != "random" else 1)]
    g0, v0, e0 = _counters(engine)
    meter.take()
    t0 = time.perf_counter()
    results = []
    for k in range(0, len(jobs), args.batch):  # batches of ``--batch`` requests
        chunk = jobs[k : k + args.batch]
        prompts = [prompt_for(engine, c) for c, _ in chunk]
        results += engine.generate(prompts, [params_for(c, s, args) for c, s in chunk])
    wall = time.perf_counter() - t0
    steps = meter.take()
    g1, v1, e1 = _counters(engine)
    outcomes = [judge(c, s, r) for (c, s), r in zip(jobs, results)]
    tokens = sum(o.tokens for o in outcomes)
    counts = Counter(o.status for o in outcomes)
    events = _delta(e1, e0)
    return {
        "group": group,
        "schemas": [c.name for c in cases],
        "needs": sorted({k for c in cases for k in _needs(c)}),
        "n": len(outcomes),
        **{k: counts.get(k, 0) for k in ("valid", "cut", "dead_end", "invalid", "error")},
        "rollbacks": sum(e.get("rollbacks", 0) for e in events.values()),
        "tokens": tokens,
        "wall_s": wall,
        "grammar_s": g1 - g0,
        "verifier_s": v1 - v0,
        "verifier_us_per_token": 1e6 * (v1 - v0) / max(tokens, 1),
        "grammar_us_per_token": 1e6 * (g1 - g0) / max(tokens, 1),
        "grammar_share": (g1 - g0) / wall,
        "verifier_share": (v1 - v0) / wall,
        **steps,
        "events": events,
        "outcomes": [asdict(o) for o in outcomes],
    }


def _needs(case: Case) -> list[str]:
    return verified_keywords(json.dumps(case.schema))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--keywords", default=",".join(KEYWORD_SCHEMAS))
    ap.add_argument("--no-dead-ends", action="store_true", help="skip the dead_ends group")
    ap.add_argument("--maskbench", type=Path, help="jsonschemabench's maskbench/data/ folder")
    ap.add_argument("--real", type=int, default=20, help="real schemas with --maskbench")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="auto", help="the engine's grammar backend")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="requests per engine.generate call")
    ap.add_argument(
        "--random",
        type=int,
        default=0,
        help="also a group of this many random schemas (random_schemas.py)",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny run: the script works")
    args = ap.parse_args()
    keywords = [k for k in args.keywords.split(",") if k]
    if args.smoke:
        args.samples, args.max_tokens, keywords = 2, 48, ["uniqueItems", "not"]
    groups: dict[str, list[Case]] = {}
    for case in keyword_cases(keywords):
        groups.setdefault(case.group, []).append(case)
    if not args.no_dead_ends:
        groups["dead_ends"] = dead_end_cases()
    if args.maskbench:
        groups["real"] = real_cases(args.maskbench, 2 if args.smoke else args.real)
    left_out = 0
    if args.random:
        groups["random"], left_out = random_cases(4 if args.smoke else args.random)
    engine = Engine(None, dtype=args.dtype, num_threads=args.threads, grammar_backend=args.backend)
    meter = StepMeter(engine)
    rows = []
    try:
        for group, cases in groups.items():
            if cases:
                rows.append(run_group(engine, meter, group, cases, args))
    finally:
        engine.shutdown()
    print(f"{'group':<22} {'n':>4} {'valid':>6} {'cut':>5} {'dead':>5} {'inval':>6} "
          f"{'err':>4} {'rollb':>5} {'chk us/tok':>11} {'grammar%':>9} {'verif%':>7} "
          f"{'g/fwd%':>7} {'v/fwd%':>7} {'o/fwd%':>7}  events")  # fmt: skip
    for r in rows:
        events = ", ".join(
            f"{k}: {v['masked']}/{v['resampled']}/{v['dead_ends']}/{v.get('rollbacks', 0)}"
            for k, v in sorted(r["events"].items())
        )
        print(f"{r['group']:<22} {r['n']:>4} {r['valid']:>6} {r['cut']:>5} {r['dead_end']:>5} "
              f"{r['invalid']:>6} {r['error']:>4} {r['rollbacks']:>5} "
              f"{r['verifier_us_per_token']:>11.1f} "
              f"{100 * r['grammar_share']:>8.1f}% {100 * r['verifier_share']:>6.1f}% "
              f"{100 * r['decode_grammar_share']:>6.1f}% {100 * r['decode_verifier_share']:>6.1f}% "
              f"{100 * r['decode_overlapped_share']:>6.1f}%"
              f"  {events}")  # fmt: skip
    if args.random:
        print(f"random: {left_out} of {args.random} schemas left out (no verified keyword, or "
              "refused in strict mode)")  # fmt: skip
    print(
        "events per keyword: masked/resampled/dead_ends/rollbacks; g/fwd, v/fwd, o/fwd: grammar"
        " step / checker seconds on the step thread, mask fills overlapped with the forward,"
        " over the forward's seconds, decode steps only"
    )
    for r in rows:
        for o in r["outcomes"]:
            if o["status"] in ("invalid", "error"):
                print(f"  {o['status']}: {r['group']}/{o['name']} seed {o['seed']}: {o['detail']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {k: str(v) for k, v in vars(args).items()}
        doc = {"args": meta, "random_left_out": left_out, "groups": rows}
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
