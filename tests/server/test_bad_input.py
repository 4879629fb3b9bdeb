"""Malformed and out-of-range requests: each gets a 4xx OpenAI-style error naming the problem,
and the server answers a normal request correctly right after. Plus engine-side failures (500)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytestmark = pytest.mark.slow

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "Hi"}]
LONG = "hello " * 9000  # ~9000 tokens: past the 8192-token context
NEAR = "hello " * 8000  # fits alone, not with 500 new tokens
UNIQUE = {"name": "x", "schema": {"type": "array", "uniqueItems": True}}
# Never fetched, so never enforceable: refused naming it (uniqueItems, not, ... are verified).
EXTREF = {
    "name": "x",
    "schema": {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
}
INVALID = {"name": "x", "schema": {"type": "objekt"}}


def comp(**kw: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 2, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 2, **kw}


def gen(**sp: Any) -> dict[str, Any]:
    return {"text": "Hi", "sampling_params": {"max_new_tokens": 2, **sp}}


# (id, method, path, body (dict, or bytes sent raw), expected status, expected `param` or None)
CASES: list[tuple[str, str, str, Any, int, str | None]] = [
    ("missing-prompt", "POST", C, {"max_tokens": 2}, 400, "prompt"),
    ("prompt-int", "POST", C, comp(prompt=5), 400, "prompt"),
    ("prompt-empty", "POST", C, comp(prompt=""), 400, "prompt"),
    ("prompt-empty-list", "POST", C, comp(prompt=[]), 400, "prompt"),
    ("prompt-id-out-of-range", "POST", C, comp(prompt=[10**7]), 400, "prompt"),
    ("prompt-id-negative", "POST", C, comp(prompt=[-1]), 400, "prompt"),
    ("prompt-too-long", "POST", C, comp(prompt=LONG), 400, "prompt"),
    ("prompt-plus-max-tokens-too-long", "POST", C, comp(prompt=NEAR, max_tokens=500), 400,
     "max_tokens"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-string", "POST", C, comp(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-float", "POST", C, comp(max_tokens=1.5), 400, "max_tokens"),
    ("max-tokens-bool", "POST", C, comp(max_tokens=True), 400, "max_tokens"),
    ("temperature-negative", "POST", C, comp(temperature=-0.5), 400, "temperature"),
    ("temperature-string", "POST", C, comp(temperature="hot"), 400, "temperature"),
    ("top-p-above-one", "POST", C, comp(top_p=1.5), 400, "top_p"),
    ("top-p-zero", "POST", C, comp(top_p=0), 400, "top_p"),
    ("top-k-below-minus-one", "POST", C, comp(top_k=-5), 400, "top_k"),
    ("min-p-above-one", "POST", C, comp(min_p=2.0), 400, "min_p"),
    ("presence-penalty-range", "POST", C, comp(presence_penalty=3.0), 400, "presence_penalty"),
    ("frequency-penalty-range", "POST", C, comp(frequency_penalty=-3.0), 400,
     "frequency_penalty"),
    ("n-zero", "POST", C, comp(n=0), 400, "n"),
    ("n-huge", "POST", C, comp(n=1000), 400, "n"),
    ("n-above-server-limit", "POST", C, comp(n=9), 400, "n"),
    ("logprobs-too-many", "POST", C, comp(logprobs=50), 400, "logprobs"),
    ("logprobs-negative", "POST", C, comp(logprobs=-1), 400, "logprobs"),
    ("stop-int", "POST", C, comp(stop=5), 400, "stop"),
    ("stop-list-of-ints", "POST", C, comp(stop=[1, 2]), 400, "stop"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400, "stop"),
    ("seed-negative", "POST", C, comp(seed=-1), 400, "seed"),
    ("seed-string", "POST", C, comp(seed="abc"), 400, "seed"),
    ("stream-string", "POST", C, comp(stream="yes"), 400, "stream"),
    ("stream-options-bad", "POST", C, comp(stream_options={"include_usage": "y"}), 400,
     "stream_options.include_usage"),
    ("unknown-field", "POST", C, comp(frobnicate=1), 400, "frobnicate"),
    ("invalid-json", "POST", C, b'{"prompt": "Hi", "max_tokens": ', 400, None),
    ("json-array-body", "POST", C, b"[1, 2, 3]", 400, None),
    ("empty-body", "POST", C, b"", 400, None),
    ("invalid-regex", "POST", C, comp(regex="(unclosed"), 400, "regex"),
    ("regex-bad-range", "POST", C, comp(regex="[z-a]"), 400, "regex"),
    ("ebnf-empty", "POST", C, comp(ebnf="  "), 400, "ebnf"),
    ("ebnf-no-root", "POST", C, comp(ebnf='start ::= "a"'), 400, "ebnf"),
    ("grammar-whitespace-unknown", "POST", C, comp(regex="a", grammar_whitespace="lots"), 400,
     "grammar_whitespace"),
    ("response-format-unknown-type", "POST", C, comp(response_format={"type": "xml"}), 400,
     "response_format.type"),
    ("json-schema-missing-schema", "POST", C,
     comp(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format.json_schema.schema"),
    ("json-schema-missing-spec", "POST", C, comp(response_format={"type": "json_schema"}), 400,
     "response_format"),
    ("json-schema-not-object", "POST", C,
     comp(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}), 400,
     "response_format.json_schema.schema"),
    ("json-schema-unsupported-keyword", "POST", C,
     comp(response_format={"type": "json_schema", "json_schema": EXTREF}), 400,
     "response_format"),
    ("json-schema-invalid", "POST", C,
     comp(response_format={"type": "json_schema", "json_schema": INVALID}), 400,
     "response_format"),
    ("two-constraints", "POST", C,
     comp(regex="a", response_format={"type": "json_object"}), 400, "regex"),
    ("best-of-unsupported", "POST", C, comp(best_of=3), 400, "best_of"),
    ("echo-with-logprobs", "POST", C, comp(echo=True, logprobs=1), 400, "echo"),
    ("logit-bias-id-out-of-range", "POST", C, comp(logit_bias={"49152": 5.0}), 400, "logit_bias"),
    ("logit-bias-value-range", "POST", C, comp(logit_bias={"1": 500.0}), 400, "logit_bias"),
    ("stop-token-id-out-of-range", "POST", C, comp(min_tokens=1, stop_token_ids=[49152]), 400,
     "stop_token_ids"),
    ("suffix-unsupported", "POST", C, comp(suffix="!"), 400, "suffix"),
    ("chat-messages-empty", "POST", CH, chat(messages=[]), 400, "messages"),
    ("chat-messages-missing", "POST", CH, {"max_tokens": 2}, 400, "messages"),
    ("chat-messages-string", "POST", CH, chat(messages="hello"), 400, "messages"),
    ("chat-role-unknown", "POST", CH, chat(messages=[{"role": "robot", "content": "x"}]), 400,
     "messages[0].role"),
    ("chat-content-int", "POST", CH, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content"),
    ("chat-content-image", "POST", CH,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400,
     "messages[0].content"),
    ("chat-max-completion-tokens-zero", "POST", CH, chat(max_completion_tokens=0), 400,
     "max_completion_tokens"),
    ("chat-top-logprobs-without-logprobs", "POST", CH, chat(top_logprobs=2), 400,
     "top_logprobs"),
    ("chat-top-logprobs-too-many", "POST", CH, chat(logprobs=True, top_logprobs=30), 400,
     "top_logprobs"),
    ("chat-tool-without-function", "POST", CH, chat(tools=[{"type": "function"}]), 400,
     "tools[0].function"),
    ("chat-json-schema-unsupported-keyword", "POST", CH,
     chat(response_format={"type": "json_schema", "json_schema": EXTREF}), 400,
     "response_format"),
    ("chat-json-schema-invalid", "POST", CH,
     chat(response_format={"type": "json_schema", "json_schema": INVALID}), 400,
     "response_format"),
    ("chat-temperature-negative", "POST", CH, chat(temperature=-1), 400, "temperature"),
    ("chat-too-long", "POST", CH, chat(messages=[{"role": "user", "content": LONG}]), 400,
     "messages"),
    ("gen-no-prompt", "POST", G, {"sampling_params": {}}, 400, "text"),
    ("gen-text-and-ids", "POST", G, {"text": "a", "input_ids": [1]}, 400, "text"),
    ("gen-ids-strings", "POST", G, {"input_ids": ["a"]}, 400, "input_ids"),
    ("gen-ids-empty", "POST", G, {"input_ids": []}, 400, "input_ids"),
    ("gen-ids-out-of-range", "POST", G, {"input_ids": [10**7]}, 400, "input_ids"),
    ("gen-max-new-tokens-negative", "POST", G, gen(max_new_tokens=-1), 400,
     "sampling_params.max_new_tokens"),
    ("gen-temperature-negative", "POST", G, gen(temperature=-1.0), 400,
     "sampling_params.temperature"),
    ("gen-unknown-sampling-param", "POST", G, gen(foo=1), 400, "sampling_params.foo"),
    ("gen-json-schema-invalid", "POST", G, gen(json_schema="{not json"), 400,
     "sampling_params.json_schema"),
    ("gen-json-schema-unsupported-keyword", "POST", G,
     gen(json_schema=json.dumps(EXTREF["schema"])), 400,
     "sampling_params.json_schema"),
    ("gen-json-schema-not-object", "POST", G, gen(json_schema="[1]"), 400,
     "sampling_params.json_schema"),
    ("gen-regex-invalid", "POST", G, gen(regex="["), 400, "sampling_params.regex"),
    ("gen-ebnf-invalid", "POST", G, gen(ebnf='root ::= "a'), 400, "sampling_params.ebnf"),
    ("gen-tool-calls-no-tools", "POST", G, gen(tool_calls={"tools": []}), 400,
     "sampling_params.tool_calls"),
    ("gen-structural-tag", "POST", G, gen(structural_tag="{}"), 400,
     "sampling_params.structural_tag"),
    ("gen-two-constraints", "POST", G, gen(regex="a", ebnf='root ::= "a"'), 400,
     "sampling_params.ebnf"),
    ("gen-n-huge", "POST", G, gen(n=100), 400, "sampling_params.n"),
    ("gen-params-count-mismatch", "POST", G,
     {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}, 400, "sampling_params"),
    ("gen-input-logprobs-negative", "POST", G,
     {**gen(), "return_logprob": True, "logprob_start_len": -5}, 400, "logprob_start_len"),
    ("gen-top-logprobs-num", "POST", G, {**gen(), "top_logprobs_num": 100}, 400,
     "top_logprobs_num"),
    ("gen-too-long", "POST", G, {"text": LONG}, 400, "text"),
    ("gen-stop-token-negative", "POST", G, gen(stop_token_ids=[-3]), 400,
     "sampling_params.stop_token_ids[0]"),
    ("abort-no-rid", "POST", "/abort_request", {}, 400, "rid"),
    ("abort-rid-int", "POST", "/abort_request", {"rid": 5}, 400, "rid"),
    ("wrong-method", "GET", C, None, 405, None),
    ("unknown-path", "POST", "/v1/embeddings", {}, 404, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(http) -> str:
    r = http.post(C, json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


def test_suite_is_large_enough():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "param"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_request(http, server, reference, name, method, path, body, status, param):
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    again = http.post(C, json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference
    assert server.process.poll() is None


def test_constraint_errors_name_the_problem(http, server):
    r = http.post(CH, json=chat(response_format={"type": "json_schema", "json_schema": EXTREF}))
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "external reference" in msg and "best-effort" in msg
    r = http.post(CH, json=chat(response_format={"type": "json_schema", "json_schema": INVALID}))
    assert r.status_code == 400 and "invalid JSON schema at #/type" in r.json()["error"]["message"]
    r = http.post(C, json=comp(regex="(unclosed"))
    assert r.status_code == 400 and "invalid regex" in r.json()["error"]["message"]
    info = server.wait_idle()
    assert info["kv_integrity"] == "ok" and info["engine_stats"]["kv_pages_used"] == 0


# ---- valid constraints are served (they were 400s before the grammar backend landed) -----------


@pytest.mark.parametrize(
    ("path", "body", "check"),
    [
        (C, comp(regex="[0-9]{3}-[0-9]{4}", max_tokens=12),
         lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
        (CH, chat(response_format={"type": "json_object"}, max_tokens=64, temperature=0),
         lambda t: isinstance(json.loads(t), dict)),
        (CH, chat(response_format={"type": "json_schema", "json_schema": UNIQUE},
                  grammar_best_effort=True, max_tokens=64, temperature=0),
         lambda t: isinstance(json.loads(t), list)),
        (CH, chat(response_format={"type": "json_schema",
                                   "json_schema": {**UNIQUE, "strict": False}},
                  max_tokens=64, temperature=0),
         lambda t: isinstance(json.loads(t), list)),
        (C, comp(ebnf='root ::= "yes" | "no"', max_tokens=4), lambda t: t in ("yes", "no")),
        (G, gen(json_schema='{"type": "object", "properties": {"n": {"type": "integer", '
                            '"minimum": 0, "maximum": 99}}, "required": ["n"]}',
                max_new_tokens=16, temperature=0),
         lambda t: isinstance(json.loads(t)["n"], int)),
        (G, gen(regex="(red|green|blue)", max_new_tokens=4),
         lambda t: t in ("red", "green", "blue")),
        (G, gen(ebnf='root ::= [a-c] [0-9]', max_new_tokens=4),
         lambda t: re.fullmatch("[a-c][0-9]", t)),
    ],
    ids=["regex", "json-object", "best-effort", "strict-false", "ebnf", "gen-json-schema",
         "gen-regex", "gen-ebnf"],
)  # fmt: skip
def test_valid_constraints_are_served(http, path, body, check):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    if path == G:
        text, reason = data["text"], data["meta_info"]["finish_reason"]["type"]
    elif path == CH:
        text, reason = data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"]
    else:
        text, reason = data["choices"][0]["text"], data["choices"][0]["finish_reason"]
    assert reason == "stop", (text, reason)
    assert check(text), text


def test_invalid_json_message(http):
    r = http.post(C, content=b'{"prompt": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]["message"]


# ---- engine-side failure of one request: 500 for it, the server keeps serving -----------------

# More tokens than the 384-page KV pool holds (6144), fewer than the 8192-token context.
TOO_BIG_FOR_POOL = "hello " * 6300


def test_engine_failure_is_a_500_and_the_server_keeps_serving(http, server, reference):
    r = http.post(C, json={"prompt": TOO_BIG_FOR_POOL, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "internal_server_error" and "KV cache" in err["message"]
    server.wait_idle()
    ok = http.post(C, json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == reference


def test_engine_failure_while_streaming_sends_an_error_event(http, server, reference):
    body = {"prompt": TOO_BIG_FOR_POOL, "max_tokens": 4, "stream": True, "n": 2}
    with http.stream("POST", C, json=body) as r:
        assert r.status_code == 200
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert "error" in events[-1] and "KV cache" in events[-1]["error"]["message"]
    assert not any("choices" in e and e["choices"][0]["finish_reason"] for e in events)
    info = server.wait_idle()
    assert info["kv_integrity"] == "ok" and info["engine_stats"]["kv_pages_used"] == 0
    gen = http.post(G, json={"text": TOO_BIG_FOR_POOL, "sampling_params": {"max_new_tokens": 2}})
    assert gen.status_code == 500 and "KV cache" in gen.json()["error"]["message"]
    ok = http.post(C, json={"prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == reference
