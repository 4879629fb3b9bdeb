"""A table of >= 200 invalid requests across every endpoint: each gets a 4xx with an
OpenAI-style error body (naming the field where there is one), and a normal request right after
it succeeds. At the end the engine holds no page and its accounting checks out."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from live_server import Server
from stress_support import assert_clean, normal_request

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "Hi"}]
JSON = {"Content-Type": "application/json"}
SP2 = {"max_new_tokens": 2}


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# Bad values shared by the OpenAI endpoints: field -> values (each one is a case).
OPENAI_BAD: dict[str, list[Any]] = {
    "max_tokens": [-1, 0, "10", 1.5, True],
    "temperature": [-0.5, "hot", [], {}],
    "top_p": [1.5, 0, -1, "x"],
    "top_k": [-5, 1.5, "x"],
    "min_p": [2.0, -0.1],
    "presence_penalty": [3.0, -3.0, "x"],
    "frequency_penalty": [3.0, -3.0],
    "repetition_penalty": [0, -1],
    "n": [0, 1000, 5, "2"],
    "seed": [-1, "abc", 2**64, 1.5],
    "stop": [5, [1, 2], [""], ["x"] * 17, "y" * 600],
    "stop_token_ids": [[49152], [-1], ["a"], [10**9]],
    "logit_bias": [
        {"abc": 1},
        {"49152": 1},
        {"5": 200},
        {"5": "x"},
        {str(i): 1 for i in range(301)},
    ],
    "min_tokens": [-1, "x", 99],
    "stream": ["yes", 1],
    "stream_options": [{"include_usage": "y"}, "x"],
    "regex": ["(unclosed", "[z-a]", "a" * 70000, 5],
    "ebnf": ["  ", 'start ::= "a"', 5],
    "response_format": [
        {"type": "bogus"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(200)}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
        {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"properties": {"a": {"$ref": "https://example.com/a.json"}}},
            },
        },
        "json",
    ],
    "grammar_whitespace": ["lots"],
    "timeout": [0, -1, "x", 10**6],
    "rid": [5, ["a"]],
    "user": [5],
    "frobnicate": [1],
}
NATIVE_BAD: dict[str, list[Any]] = {
    "max_new_tokens": [-1, "10", 1.5, True],
    "min_new_tokens": [-1, 99],
    "temperature": [-0.5, "hot"],
    "top_p": [1.5, 0],
    "top_k": [-5, "x"],
    "min_p": [2.0],
    "presence_penalty": [3.0],
    "frequency_penalty": [-3.0],
    "repetition_penalty": [0],
    "n": [0, 5, 1000],
    "seed": [-1, "x"],
    "stop": [5, ["x"] * 17, "y" * 600],
    "stop_token_ids": [[49152], [-1]],
    "logit_bias": [{"abc": 1}, {"49152": 1}, {"5": 200}],
    "json_schema": ["{", '{"type": "objekt"}', "[]", "x" * 70000],
    "regex": ["(unclosed", "[z-a]"],
    "ebnf": ["  ", 'start ::= "a"'],
    "structural_tag": ["{}"],
    "grammar_whitespace": ["lots"],
    "custom_params": [{"a": 1}],
    "frobnicate": [1],
}


def _cases() -> list[tuple[str, str, str, Any, str | None]]:
    """(id, method, path, body (dict, or bytes sent raw), expected `param` or None)."""
    out: list[tuple[str, str, str, Any, str | None]] = []
    for path, base, name in (
        (C, {"prompt": "Hi", "max_tokens": 2}, "cmpl"),
        (CH, {"messages": MSG, "max_tokens": 2}, "chat"),
    ):
        for field, values in OPENAI_BAD.items():
            for k, value in enumerate(values):
                out.append((f"{name}-{field}-{k}", "POST", path, {**base, field: value}, field))
    for field, values in NATIVE_BAD.items():
        for k, value in enumerate(values):
            sp = {"max_new_tokens": 2, field: value}
            out.append(
                (
                    f"gen-{field}-{k}",
                    "POST",
                    G,
                    {"text": "Hi", "sampling_params": sp},
                    "sampling_params",
                )
            )
    prompt_bad = [5, "", [], [10**7], [-1], [[]], "a" * 5000, "hello " * 100, [1.5], None]
    for k, value in enumerate(prompt_bad):
        out.append((f"cmpl-prompt-{k}", "POST", C, {"prompt": value, "max_tokens": 2}, "prompt"))
    out += [
        ("cmpl-logprobs-50", "POST", C, {"prompt": "Hi", "logprobs": 50}, "logprobs"),
        ("cmpl-logprobs-neg", "POST", C, {"prompt": "Hi", "logprobs": -1}, "logprobs"),
        ("cmpl-echo-logprobs", "POST", C, {"prompt": "Hi", "echo": True, "logprobs": 1}, "echo"),
        ("cmpl-suffix", "POST", C, {"prompt": "Hi", "suffix": "x"}, "suffix"),
        ("cmpl-best-of", "POST", C, {"prompt": "Hi", "best_of": 3}, "best_of"),
        ("cmpl-batch-too-long", "POST", C, {"prompt": ["Hi"] * 65}, "prompt"),
        (
            "cmpl-max-tokens-past-context",
            "POST",
            C,
            {"prompt": "Hi", "max_tokens": 500},
            "max_tokens",
        ),
        (
            "cmpl-two-constraints",
            "POST",
            C,
            {"prompt": "Hi", "regex": "a", "ebnf": 'root ::= "a"'},
            None,
        ),
    ]
    messages_bad = [
        [],
        "hi",
        [{"role": "bogus", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "a" * 5000}],
        [{"role": "user", "content": "hello " * 100}],
        None,
    ]
    for k, value in enumerate(messages_bad):
        out.append(
            (f"chat-messages-{k}", "POST", CH, {"messages": value, "max_tokens": 2}, "messages")
        )
    out += [
        (
            "chat-top-logprobs-alone",
            "POST",
            CH,
            {"messages": MSG, "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "chat-top-logprobs-50",
            "POST",
            CH,
            {"messages": MSG, "logprobs": True, "top_logprobs": 50},
            "top_logprobs",
        ),
        ("chat-tools", "POST", CH, {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
        (
            "chat-tool-choice",
            "POST",
            CH,
            {"messages": MSG, "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "chat-agp-and-continue",
            "POST",
            CH,
            {"messages": MSG, "add_generation_prompt": True, "continue_final_message": True},
            "add_generation_prompt",
        ),
        (
            "chat-max-completion-tokens-0",
            "POST",
            CH,
            {"messages": MSG, "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
    ]
    gen_bad = [
        ("both", {"text": "Hi", "input_ids": [1]}, "text"),
        ("neither", {"sampling_params": {"max_new_tokens": 2}}, "text"),
        ("ids-out-of-range", {"input_ids": [49152], "sampling_params": SP2}, "input_ids"),
        ("ids-negative", {"input_ids": [-3], "sampling_params": SP2}, "input_ids"),
        ("ids-empty", {"input_ids": [], "sampling_params": SP2}, "input_ids"),
        ("ids-empty-batch-item", {"input_ids": [[]], "sampling_params": SP2}, "input_ids"),
        ("text-empty-batch", {"text": []}, "text"),
        ("text-too-long", {"text": "a" * 5000}, "text"),
        ("params-count", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ("logprob-start", {"text": "Hi", "logprob_start_len": -2}, "logprob_start_len"),
        (
            "top-logprobs-num",
            {"text": "Hi", "return_logprob": True, "top_logprobs_num": 50},
            "top_logprobs_num",
        ),
        ("rid-dup", {"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ("rid-count", {"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ("timeout-zero", {"text": "Hi", "timeout": 0}, "timeout"),
        ("lora", {"text": "Hi", "lora_path": "x"}, "lora_path"),
        ("stream-str", {"text": "Hi", "stream": "y"}, "stream"),
    ]
    out += [(f"gen-{n}", "POST", G, body, p) for n, body, p in gen_bad]
    raw = [
        b'{"prompt": "Hi", "max_tokens": ',
        b"[1, 2, 3]",
        b"",
        b'"just a string"',
        b'{"prompt": "\xff\xfe"}',
        b"\x00\x01\x02",
    ]
    for path in (C, CH, G):
        out += [(f"raw-{path}-{k}", "POST", path, body, None) for k, body in enumerate(raw)]
    out += [
        ("abort-empty", "POST", "/abort_request", {}, "rid"),
        ("abort-rid-int", "POST", "/abort_request", {"rid": 5}, "rid"),
        ("abort-unknown-field", "POST", "/abort_request", {"x": 1}, "x"),
        (
            "server-info-bad-flag",
            "GET",
            "/get_server_info?check_integrity=maybe",
            None,
            "query.check_integrity",
        ),
        ("get-completions", "GET", C, None, None),
        ("unknown-path", "GET", "/v1/nothing", None, None),
        ("delete-generate", "DELETE", G, None, None),
    ]
    return out


CASES = _cases()


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 200, len(CASES)


@pytest.mark.parametrize(
    ("method", "path", "body", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid_request_then_normal(
    http: httpx.Client, method: str, path: str, body: Any, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers=JSON)
    elif body is None:
        r = http.request(method, path)
    else:
        r = http.request(method, path, json=body)
    assert 400 <= r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    error = r.json()["error"]
    assert error["message"], r.text
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    normal_request(http)


def test_content_type_and_size_limits(http: httpx.Client) -> None:
    r = http.post(C, content=b'{"prompt": "Hi"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    big = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    r = http.post(C, content=big, headers=JSON)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks() -> Any:  # no Content-Length: refused while reading, never buffered whole
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 2**20
        yield b'"}'

    r = http.post(C, content=chunks(), headers=JSON)
    assert r.status_code == 413
    normal_request(http)


def test_clean_after_the_table(stress_server: Server, http: httpx.Client) -> None:
    normal_request(http)
    assert_clean(stress_server)
