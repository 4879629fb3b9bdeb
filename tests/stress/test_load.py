"""Load: 256 concurrent requests (completions / chat / native, streamed or not, constrained or
not, n > 1; every sixth is a stream cut after its first chunk) on a KV pool far too small for
them, so that the scheduler retracts. Every uncut request succeeds with the same greedy output
as an unpressured in-process engine; afterwards 0 pages are held, nothing runs, and the page
accounting checks out."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Server
from stress_support import assert_clean

from radixlm import Engine, SamplingParams

NUM_REQUESTS = 256
MAX_TOKENS = 16
REGEX = "[a-z]{2,6}( [a-z]{2,6})?"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def _spec(k: int) -> dict[str, Any]:
    """Request k: its endpoint, prompt, options, and whether it is cut mid-stream."""
    prompt = f"The story of {WORDS[k % 8]} and {WORDS[(k // 8) % 8]} begins"
    kind = ["cmpl", "chat", "gen", "cmpl-regex", "chat-json", "cmpl-n2"][k % 6]
    return {
        "k": k,
        "kind": kind,
        "prompt": prompt,
        "stream": k % 2 == 1 or k % 6 == 5,
        "cut": k % 6 == 5,
        "n": 2 if kind == "cmpl-n2" else 1,
    }


def _body(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    kind, prompt, stream = spec["kind"], spec["prompt"], spec["stream"]
    common = {"temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream, "n": spec["n"]}
    if kind.startswith("chat"):
        body = {**common, "messages": [{"role": "user", "content": prompt}]}
        if kind == "chat-json":
            rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
            body["response_format"] = rf
        return "/v1/chat/completions", body
    if kind == "gen":
        sp = {"temperature": 0, "max_new_tokens": MAX_TOKENS}
        return "/generate", {"text": prompt, "sampling_params": sp, "stream": stream}
    body = {**common, "prompt": prompt}
    if kind == "cmpl-regex":
        body["regex"] = REGEX
    return "/v1/completions", body


def _texts_from_stream(kind: str, events: list[dict[str, Any]], n: int) -> list[str]:
    texts = [""] * n
    for ev in events:
        assert "error" not in ev, ev
        if kind == "gen":
            texts[ev["index"]] = ev["text"]  # cumulative
            continue
        for ch in ev["choices"]:
            piece = ch["delta"].get("content") if "delta" in ch else ch["text"]
            texts[ch["index"]] += piece or ""
    return texts


async def _run_one(client: httpx.AsyncClient, spec: dict[str, Any]) -> list[str] | None:
    path, body = _body(spec)
    kind = spec["kind"]
    if not spec["stream"]:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        if kind == "gen":
            return [data["text"]]
        return [c["message"]["content"] if "message" in c else c["text"] for c in data["choices"]]
    events: list[dict[str, Any]] = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[6:]))
            if spec["cut"]:
                return None  # leaving the block closes the connection mid-stream
    return _texts_from_stream(kind, events, spec["n"])


def _reference(model_dir: Path, specs: list[dict[str, Any]]) -> dict[int, list[str]]:
    """The same requests on an in-process engine with a pool big enough for all of them."""
    from radixlm.runtime.grammar.constraint import Constraint

    engine = Engine(
        str(model_dir), dtype="float32", num_pages=2048, max_model_len=64, num_threads=1
    )
    try:
        prompts, params, keys = [], [], []
        for spec in specs:
            if spec["cut"]:
                continue
            kind = spec["kind"]
            prompt = spec["prompt"]
            if kind.startswith("chat"):
                prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
            constraint = None
            if kind == "cmpl-regex":
                constraint = Constraint.from_params(regex=REGEX)
            elif kind == "chat-json":
                constraint = Constraint.from_params(json_schema=SCHEMA)
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    temperature=0.0, max_new_tokens=MAX_TOKENS, n=spec["n"], constraint=constraint
                )
            )
            keys.append(spec["k"])
        results = engine.generate(prompts, params)
        return {k: [c.text for c in res.outputs] for k, res in zip(keys, results)}
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def specs() -> list[dict[str, Any]]:
    return [_spec(k) for k in range(NUM_REQUESTS)]


def test_load_with_retraction_and_cuts(
    stress_server: Server, tiny_llama_dir: Path, specs: list[dict[str, Any]]
) -> None:
    before = stress_server.info()["engine_stats"]["num_retractions"]

    async def main() -> list[list[str] | None]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=stress_server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(_run_one(c, s) for s in specs))

    got = asyncio.run(main())
    info = assert_clean(stress_server)
    retractions = info["engine_stats"]["num_retractions"] - before
    cut = sum(s["cut"] for s in specs)
    print(f"load: {NUM_REQUESTS} requests, {cut} cut, {retractions} retractions")
    assert retractions > 0, "the KV pool was not under pressure"
    want = _reference(tiny_llama_dir, specs)
    mismatches = [
        (s["k"], s["kind"], got[s["k"]], want[s["k"]])
        for s in specs
        if not s["cut"] and got[s["k"]] != want[s["k"]]
    ]
    assert not mismatches, mismatches[:5]
