"""Grammar-constrained decoding on the real default model (float32, greedy), both backends:
JSON schemas validated with `jsonschema`, regexes, EBNF, choices, a mixed batch, rejections,
jump-forward on vs off, n > 1, truncation, retraction."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from constrained_cases import CHOICES, EBNF, EBNF_REGEX, NUMERIC_BOUNDS, REGEXES, SCHEMAS

from radixlm import Engine, SamplingParams
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.jump_forward import jump_forward
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.outputs import GenerateResult

pytestmark = pytest.mark.slow

BACKENDS = ("xgrammar", "outlines", "llguidance")
MAX_NEW = 160  # every schema output above is far shorter; finishing by length is a failure
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
_ENGINES: dict[str, Engine] = {}
_RESULTS: dict[str, dict[str, Any]] = {}


def _engine(model_dir: Any, key: str, **kw: Any) -> Engine:
    if key not in _ENGINES:
        # A long grammar timeout: many cold compiles queue on two workers on a slow CI box.
        _ENGINES[key] = Engine(
            str(model_dir), dtype="float32", num_pages=kw.pop("num_pages", 512),
            debug_integrity=True, grammar_timeout_s=300.0, **kw,
        )  # fmt: skip
    return _ENGINES[key]


@pytest.fixture(scope="module", autouse=True)
def _shutdown() -> Iterator[None]:
    yield
    for engine in _ENGINES.values():
        engine.shutdown()
    _ENGINES.clear()
    _RESULTS.clear()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def engine(default_model_dir: Any, backend: str) -> Engine:
    return _engine(default_model_dir, backend, grammar_backend=backend)


@pytest.fixture
def xgr(default_model_dir: Any) -> Engine:
    return _engine(default_model_dir, "xgrammar", grammar_backend="xgrammar")


def chat(engine: Engine, text: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def schema_prompt(engine: Engine, name: str) -> str:
    what, schema = SCHEMAS[name]
    return chat(engine, f"Give me {what} as JSON matching this schema: {json.dumps(schema)}")


def greedy(constraint: Any = None, **kw: Any) -> SamplingParams:
    return SamplingParams(
        **{"max_new_tokens": MAX_NEW, "temperature": 0.0, **kw}, constraint=constraint
    )


def supported(engine: Engine) -> list[str]:
    """The schemas the engine's backend enforces (outlines: no numeric bounds)."""
    if engine.config.grammar_backend == "outlines":
        return [n for n in SCHEMAS if n not in NUMERIC_BOUNDS]
    return list(SCHEMAS)


def precompile(engine: Engine, params: list[SamplingParams]) -> None:
    """Compile every constraint first, so that a batch is admitted together (not staggered by
    compile times) and its step counts do not depend on how fast the machine compiles."""
    for p in params:
        assert p.constraint is not None
        engine.grammar_manager.compile_sync(p.constraint)


def run_schemas(engine: Engine, key: str) -> dict[str, Any]:
    """All supported schemas in one batch (memoized per engine): results and forward count."""
    if key not in _RESULTS:
        names = supported(engine)
        params = [greedy({"json_schema": SCHEMAS[n][1]}) for n in names]
        precompile(engine, params)
        before = engine.stats()
        results = engine.generate([schema_prompt(engine, n) for n in names], params)
        after = engine.stats()
        _RESULTS[key] = {
            "results": dict(zip(names, results)),
            "forwards": after.num_forwards - before.num_forwards,
            "jump_forward_tokens": after.num_jump_forward_tokens - before.num_jump_forward_tokens,
        }
    return _RESULTS[key]


def assert_valid(name: str, result: GenerateResult) -> None:
    assert result.error is None, result.error
    assert result.finish_reason == "stop", (name, result.text)
    jsonschema.validate(json.loads(result.text), SCHEMAS[name][1], format_checker=FORMATS)


def whitespace_outside_strings(text: str) -> bool:
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped = not escaped and ch == "\\"
            in_string = escaped or ch != '"'
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return True
    return False


def assert_clean(engine: Engine) -> None:
    assert engine.wait_idle(timeout=30)
    engine.check_integrity()
    s = engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0 and s.kv_pages_used == 0


# ---- outputs satisfy their constraints ---------------------------------------------------------


def test_schemas_validate(engine: Engine, backend: str) -> None:
    run = run_schemas(engine, backend)
    names = supported(engine)
    assert len(names) >= 15 and len(SCHEMAS) >= 18
    for name in names:
        assert_valid(name, run["results"][name])
        assert not whitespace_outside_strings(run["results"][name].text)  # compact JSON
    # The keywords outlines cannot enforce are refused by name, not silently ignored.
    for name in set(SCHEMAS) - set(names):
        with pytest.raises(ValueError, match="minimum") as exc:
            engine.generate("x", greedy({"json_schema": SCHEMAS[name][1]}))
        assert "outlines" in str(exc.value) and "best-effort" in str(exc.value)
    assert_clean(engine)


def test_json_whitespace_any(xgr: Engine) -> None:
    assert whitespace_outside_strings('{"a": "b c"}') and not whitespace_outside_strings(
        '{"a":"b c"}'
    )
    name = "array_of_objects"
    lax = greedy({"json_schema": SCHEMAS[name][1], "whitespace": "any"})
    prompt = chat(xgr, f"Give me {SCHEMAS[name][0]} as pretty-printed JSON, with indentation.")
    r = xgr.generate(prompt, lax)
    assert_valid(name, r)
    assert whitespace_outside_strings(r.text), r.text  # the model likes its newlines


def test_regexes_fully_match(engine: Engine) -> None:
    names = list(REGEXES)
    prompts = [chat(engine, f"Write {REGEXES[n][0]}.") for n in names]
    results = engine.generate(prompts, [greedy({"regex": REGEXES[n][1]}) for n in names])
    for name, r in zip(names, results):
        assert r.finish_reason == "stop", (name, r.text)
        assert re.fullmatch(REGEXES[name][1], r.text), (name, r.text)


def test_ebnf(engine: Engine, backend: str) -> None:
    prompt = chat(engine, "Write an SQL query that finds the name of user 7.")
    if backend in ("outlines", "llguidance"):  # regular languages / Lark, not xgrammar's EBNF
        with pytest.raises(ValueError, match="ebnf constraints are not supported"):
            engine.generate(prompt, greedy({"ebnf": EBNF}))
        return
    r = engine.generate(prompt, greedy({"ebnf": EBNF}))
    assert r.finish_reason == "stop" and re.fullmatch(EBNF_REGEX, r.text), r.text


def test_choices(engine: Engine) -> None:
    texts = ["I love this phone, it is great!", "This was the worst meal of my life."]
    prompts = [chat(engine, f"Sentiment of: {t}") for t in texts]
    results = engine.generate(prompts, greedy({"choices": CHOICES}))
    assert all(r.text in CHOICES and r.finish_reason == "stop" for r in results)


def test_mixed_batch_keeps_unconstrained_outputs(xgr: Engine) -> None:
    plain = [chat(xgr, q) for q in ("What is a radix tree?", "Name three rivers.", "Hi!")]
    p = greedy(max_new_tokens=24)
    xgr.flush_cache()
    alone = [r.output_token_ids for r in xgr.generate(plain, p)]
    xgr.flush_cache()
    names = ["nested", "array_of_objects", "refs"]
    constrained = [schema_prompt(xgr, n) for n in names]
    mixed = xgr.generate(
        [plain[0], constrained[0], plain[1], constrained[1], plain[2], constrained[2]],
        [p, *[greedy({"json_schema": SCHEMAS[n][1]}) for n in names[:1]], p,
         greedy({"json_schema": SCHEMAS[names[1]][1]}), p,
         greedy({"json_schema": SCHEMAS[names[2]][1]})],
    )  # fmt: skip
    assert [mixed[i].output_token_ids for i in (0, 2, 4)] == alone
    for name, i in zip(names, (1, 3, 5)):
        assert_valid(name, mixed[i])
    assert_clean(xgr)


# ---- rejections --------------------------------------------------------------------------------

BAD: list[tuple[dict[str, Any], str]] = [
    # NOTE: uniqueItems, not, ... are enforced by the verifier (issue 26); an external $ref is
    # never fetched: refused, naming it.
    ({"json_schema": {"type": "array",
                      "items": {"type": "integer", "$ref": "https://example.com/n.json"}}},
     "external reference"),
    ({"json_schema": {"type": "objekt"}}, "invalid JSON schema at #/type"),
    ({"json_schema": {"type": "object", "required": "a"}}, "invalid JSON schema at #/required"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": "[z-a]"}, "regex"),
    ({"choices": []}, "choices"),
]  # fmt: skip


def test_rejections_leave_the_engine_serving(engine: Engine) -> None:
    for fields, needle in BAD:
        with pytest.raises(ValueError, match=re.escape(needle)):
            engine.generate("Hi", greedy(fields))
    # Best effort still serves a schema it can enforce.
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    lax = {"json_schema": unique, "best_effort": True}
    r = engine.generate(chat(engine, "Three numbers as a JSON list."), greedy(lax))
    assert r.finish_reason == "stop" and all(isinstance(v, int) for v in json.loads(r.text))
    ok = engine.generate(chat(engine, "Hi"), greedy({"choices": CHOICES}))
    assert ok.text in CHOICES
    assert_clean(engine)


# ---- jump-forward --------------------------------------------------------------------------------


def jump_divergence(mgr: GrammarManager, schema: Any, tokens: list[int]) -> str | None:
    """Replay jump-forward decoding over `tokens` (an output decoded without it): where it would
    append tokens other than the ones the model chose for the same forced text, describe the
    first such place; None when jump-forward would have produced exactly `tokens`."""
    constraint = Constraint.from_params(json_schema=schema)
    matcher = mgr.compile_sync(constraint).new_matcher()
    pos = 0
    while pos < len(tokens):
        tok = tokens[pos]
        assert matcher.accept_token(tok)
        jf = jump_forward(matcher, mgr.vocab, [tok], max_tokens=MAX_NEW - pos - 1)
        keep = pos + 1 - jf.num_rollback
        expected = tokens[:keep] + list(jf.token_ids)
        if tokens[: len(expected)] != expected:
            forced = mgr.vocab.join(jf.token_ids) or b""
            chosen = tokens[keep : keep + len(jf.token_ids) + 1]
            return (
                f"forced {forced.decode()!r}: model tokens "
                f"{[mgr.vocab.join([t]) for t in chosen]} vs jump-forward's "
                f"{[mgr.vocab.join([t]) for t in jf.token_ids]}"
            )
        pos = len(expected)
    return None


def test_jump_forward_saves_forwards_and_keeps_outputs(
    default_model_dir: Any, engine: Engine, backend: str
) -> None:
    on = run_schemas(engine, backend)
    off_engine = _engine(
        default_model_dir, f"{backend}-nojf", grammar_backend=backend, enable_jump_forward=False
    )
    assert not off_engine.grammar_manager.jump_forward_enabled
    off = run_schemas(off_engine, f"{backend}-nojf")
    assert off["jump_forward_tokens"] == 0 and on["jump_forward_tokens"] > 0
    assert on["forwards"] < off["forwards"] * 0.8, (on["forwards"], off["forwards"])
    differ: dict[str, str] = {}
    for name in supported(engine):
        r_on, r_off = on["results"][name], off["results"][name]
        assert_valid(name, r_off)
        assert_valid(name, r_on)
        why = jump_divergence(engine.grammar_manager, SCHEMAS[name][1], r_off.output_token_ids)
        if why is None:  # same tokenization of every forced text: the very same output
            assert r_on.output_token_ids == r_off.output_token_ids, name
        elif r_on.text != r_off.text:
            differ[name] = why
    print(
        f"\n[{backend}] forwards with jump-forward {on['forwards']} vs {off['forwards']} "
        f"without; {on['jump_forward_tokens']} forced tokens; {len(differ)} of "
        f"{len(supported(engine))} texts differ:"
    )
    for name, why in differ.items():
        print(f"  {name}: {on['results'][name].text!r} vs {off['results'][name].text!r}; {why}")
    assert len(differ) < len(supported(engine)) // 2


def test_loose_masks_change_no_greedy_token(default_model_dir: Any, monkeypatch) -> None:
    """Short string bounds fill masks from a twin grammar without them (``LooseMasks``) and
    check each sampled token on the exact grammar: greedy outputs are those of exact masks,
    token for token, over every schema (most bound a string to 16 characters or fewer)."""
    from radixlm.runtime.grammar.llguidance_backend import LLGuidanceBackend

    loose_engine = _engine(default_model_dir, "llguidance", grammar_backend="llguidance")
    loose = run_schemas(loose_engine, "llguidance")
    person = Constraint.from_params(json_schema=SCHEMAS["person"][1])
    assert loose_engine.grammar_manager.compile_sync(person).new_matcher().loose_masks
    monkeypatch.setattr(LLGuidanceBackend, "_loose_twin", lambda self, c: None)
    exact_engine = _engine(default_model_dir, "llguidance-exact", grammar_backend="llguidance")
    exact = run_schemas(exact_engine, "llguidance-exact")
    bounded = 0
    for name in supported(exact_engine):
        assert_valid(name, exact["results"][name])
        assert loose["results"][name].output_token_ids == exact["results"][name].output_token_ids
        bounded += '"maxLength"' in json.dumps(SCHEMAS[name][1])
    assert bounded >= 5
    events = exact_engine.stats().verifier_events
    assert "maxLength" not in events  # exact masks: nothing to check


# ---- n > 1, limits, retraction -------------------------------------------------------------------


def test_n_branches_each_validate(engine: Engine) -> None:
    name = "array_of_objects"
    p = SamplingParams(
        n=3, temperature=0.8, seed=11, max_new_tokens=MAX_NEW,
        constraint={"json_schema": SCHEMAS[name][1]}, logprobs=True,
    )  # fmt: skip
    r = engine.generate(schema_prompt(engine, name), p)
    assert len(r.outputs) == 3
    for out in r.outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS[name][1])
        assert len(out.logprobs) == len(out.output_token_ids)
        assert all(lp.logprob <= 0.0 for lp in out.logprobs)
    assert_clean(engine)


def test_truncated_json_reports_length_and_stop_strings_apply(xgr: Engine) -> None:
    name = "nested"
    schema = {"json_schema": SCHEMAS[name][1]}
    full = xgr.generate(schema_prompt(xgr, name), greedy(schema)).text
    short = xgr.generate(schema_prompt(xgr, name), greedy(schema, max_new_tokens=5))
    assert short.finish_reason == "length" and len(short.output_token_ids) == 5
    assert full.startswith(short.text) and short.text != full
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.text)
    stopped = xgr.generate(schema_prompt(xgr, name), greedy(schema, stop=["address"]))
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason == "address"
    assert full.startswith(stopped.text) and "address" not in stopped.text
    assert_clean(xgr)


def test_retraction_keeps_constrained_outputs(default_model_dir: Any, xgr: Engine) -> None:
    names = ["array_of_objects", "nested", "refs", "const"]
    params = [greedy({"json_schema": SCHEMAS[n][1]}) for n in names]
    prompts = [schema_prompt(xgr, n) for n in names]
    xgr.flush_cache()
    want = [r.output_token_ids for r in xgr.generate(prompts, params)]
    # 4 prompts of 104-173 tokens (+ 20-40 generated each) in 24 pages of 16 tokens, prefilled
    # in chunks of 32 so that all are admitted: some must be retracted.
    small = _engine(default_model_dir, "small", num_pages=24, chunked_prefill_size=32)
    precompile(small, params)
    got = small.generate(prompts, params)
    assert small.stats().num_retractions > 0
    for name, r, w in zip(names, got, want):
        assert_valid(name, r)
        assert r.output_token_ids == w, name
    assert_clean(small)


# ---- compiles run off the step loop ------------------------------------------------------------


def test_slow_compile_blocks_nobody_and_a_timeout_fails_one_request(default_model_dir: Any) -> None:
    """outlines compiles free-form JSON into a large automaton (seconds): meanwhile an
    unconstrained request submitted after it is served; with a short timeout the constrained
    request alone fails."""
    import queue
    import time

    engine = _engine(default_model_dir, "outlines", grammar_backend="outlines")
    mgr = engine.grammar_manager
    done: queue.SimpleQueue[tuple[str, float, Any]] = queue.SimpleQueue()

    def submit(rid: str, params: SamplingParams) -> None:
        def sink(out: Any) -> None:
            if out.finished:
                done.put((rid, time.monotonic(), out))

        engine.submit(chat(engine, "A JSON object, please."), params, sink=sink, request_id=rid)

    timeout_s, mgr.timeout_s = mgr.timeout_s, 0.2
    try:
        submit("slow", greedy({"json_object": True, "whitespace": "any"}, max_new_tokens=8))
        submit("plain", greedy(max_new_tokens=4))
        finished = [done.get(timeout=120) for _ in range(2)]
    finally:
        mgr.timeout_s = timeout_s
    by_id = {rid: out for rid, _, out in finished}
    assert by_id["slow"].finish_reason == "error" and "longer than" in by_id["slow"].error
    assert by_id["plain"].finish_reason == "length" and by_id["plain"].error is None

    t0 = time.monotonic()
    submit("json", greedy({"json_object": True}, max_new_tokens=8))
    submit("plain2", greedy(max_new_tokens=4))
    order = [done.get(timeout=120) for _ in range(2)]
    assert [rid for rid, _, _ in order] == ["plain2", "json"]
    assert order[0][1] - t0 < order[1][1] - t0
    assert order[1][2].finish_reason in ("stop", "length") and order[1][2].error is None
    assert_clean(engine)


SPEC = {
    "ngram": {"speculative_algorithm": "ngram"},
    # self-speculation: the default model with int4 weights drafts for itself
    "draft": {
        "speculative_algorithm": "draft",
        "speculative_draft_model": "default",
        "speculative_draft_quantization": "int4",
    },
}


@pytest.mark.parametrize("algorithm", list(SPEC))
def test_speculative_decoding_under_a_schema_changes_no_token(
    default_model_dir: Any, algorithm: str
) -> None:
    """JSON extraction copies values from the document, so drafts are found; verified under
    per-row grammar masks, greedy float32 output equals plain decoding's, token for token
    (ngram drafts carry the text the grammar forces, jump-forward's tokens, and close the
    values their source leaves; a draft model's drafts stop where the grammar forces text)."""
    doc = (
        "Invoice 4711 from ACME Tools Ltd, 12 Harbour Road, Bristol, dated 2024-03-05, "
        "total 1249.50 EUR, contact: billing@acme-tools.example"
    )
    schema = {
        "type": "object",
        "properties": {
            "number": {"type": "string"},
            "company": {"type": "string"},
            "address": {"type": "string"},
            "email": {"type": "string"},
        },
        "required": ["number", "company", "address", "email"],
    }
    plain = _engine(default_model_dir, "xgrammar", grammar_backend="xgrammar")
    spec = _engine(
        default_model_dir, f"xgrammar-spec-{algorithm}", grammar_backend="xgrammar",
        **SPEC[algorithm],
    )  # fmt: skip
    keys = ("name", "born", "city", "occupation", "email")
    person = {
        "type": "object",
        "properties": {k: {"type": "integer" if k == "born" else "string"} for k in keys},
        "required": list(keys),
        "additionalProperties": False,
    }
    hopper = (
        "Grace Hopper was born in 1906 in New York City. She worked as a computer scientist "
        "and naval officer; write to her at grace.hopper@navy.example."
    )
    for task, sch in ((f"the invoice fields as JSON.\n\n{doc}", schema), (
        "the person in this document as JSON with the keys name, born, city, occupation "
        f"and email, copying the values from the text.\n\n{hopper}", person,
    )):  # fmt: skip
        prompt = chat(plain, f"Extract {task}")
        params = greedy({"json_schema": sch})
        a, b = plain.generate(prompt, params), spec.generate(prompt, params)
        assert b.outputs[0].output_token_ids == a.outputs[0].output_token_ids
        jsonschema.validate(json.loads(b.text), sch)
    assert spec.stats().spec_accepted_tokens > 0
    assert_clean(spec)
