"""SGLang-native endpoints, /metrics, /health and API-key auth, over httpx."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

GREEDY = {"max_new_tokens": 8, "temperature": 0}


def sse_events(lines: list[str]) -> list[dict]:
    data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_generate_single(http):
    r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": GREEDY})
    assert r.status_code == 200
    out = r.json()
    meta = out["meta_info"]
    assert out["text"] and len(out["output_ids"]) == meta["completion_tokens"] <= 8
    assert meta["prompt_tokens"] == 5 and meta["cached_tokens"] >= 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == 8


def test_generate_batch_text_and_input_ids(http, tokenizer):
    prompts = ["Water boils at", "My favourite book is"]
    batch = http.post("/generate", json={"text": prompts, "sampling_params": GREEDY}).json()
    assert isinstance(batch, list) and len(batch) == 2
    singles = [
        http.post("/generate", json={"text": p, "sampling_params": GREEDY}).json()["text"]
        for p in prompts
    ]
    assert [b["text"] for b in batch] == singles
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert [b["text"] for b in by_ids] == singles
    assert [b["meta_info"]["prompt_tokens"] for b in by_ids] == [len(i) for i in ids]


def test_generate_per_prompt_params_and_n(http):
    body = {
        "text": ["Water boils at", "Water boils at"],
        "sampling_params": [{"max_new_tokens": 2, "temperature": 0}, GREEDY],
    }
    out = http.post("/generate", json=body).json()
    assert [o["meta_info"]["completion_tokens"] <= m for o, m in zip(out, (2, 8))] == [True] * 2
    assert out[1]["text"].startswith(out[0]["text"])
    n3 = http.post(
        "/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "n": 3, "seed": 5}},
    ).json()
    assert [o["index"] for o in n3] == [0, 1, 2]


def test_generate_stream_cumulative(http):
    body = {"text": "Once upon a time", "sampling_params": GREEDY}
    full = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(r.iter_lines()))
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == full["text"]
    finishes = [e["meta_info"]["finish_reason"] for e in events]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] is not None


def test_generate_logprobs(http):
    body = {
        "text": "The capital of France is",
        "sampling_params": GREEDY,
        "return_logprob": True,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    meta = http.post("/generate", json=body).json()["meta_info"]
    out, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(out) == len(top) == meta["completion_tokens"]
    for (lp, tid, text), alts in zip(out, top):
        assert lp <= 0 and isinstance(tid, int) and isinstance(text, str)
        assert len(alts) == 3 and alts[0][1] == tid  # greedy picks the top token


def test_generate_input_logprobs(http, tokenizer):
    """`logprob_start_len` returns prompt logprobs in SGLang's format; the scores of a
    continuation are consistent with the output logprob of the same tokens."""
    text = "The capital of France is Paris"
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 2,
    }
    meta = http.post("/generate", json=body).json()["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids[2:]
    assert all(lp <= 0 for lp, _, _ in inp)
    # The logprob of " Paris" after the prefix equals the first output logprob for that prefix.
    body2 = {
        "input_ids": ids[:-1],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 20,
    }
    top = http.post("/generate", json=body2).json()["meta_info"]["output_top_logprobs"][0]
    paris = {t: lp for lp, t, _ in top}.get(ids[-1])
    assert paris is not None and abs(paris - inp[-1][0]) < 1e-3


def test_model_info_and_server_info(http, server):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"]
    s = server.info()
    assert s["server_config"]["api_key"] == "***" and s["server_config"]["max_n"] == 8
    assert s["engine_stats"]["kv_pages_total"] == 384 and s["kv_integrity"] == "ok"


def test_health(server, http):
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # no key needed
    assert http.get("/health_generate").status_code == 200


def test_flush_cache_and_abort_request(http, server):
    http.post("/generate", json={"text": "A long shared prefix " * 20, "sampling_params": GREEDY})
    server.wait_idle()
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"]
    stats = server.info()["engine_stats"]
    assert stats["kv_pages_cached"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert http.post("/abort_request", json={"rid": "no-such-request"}).json()["found"] is False


def test_abort_request_by_rid_finishes_with_abort(http, server):
    import threading

    result = {}

    def run():
        body = {
            "text": "Count: 1, 2, 3,",
            "rid": "abort-me",
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
        }
        result["r"] = http.post("/generate", json=body)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while not server.info()["active_requests"]:
        assert time.monotonic() < deadline, "the request never became active"
        threading.Event().wait(0.05)
    assert http.post("/abort_request", json={"rid": "abort-me"}).json()["found"] is True
    t.join(timeout=30)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 2000
    server.wait_idle()


def test_metrics_prometheus(http, server):
    def scrape() -> dict[str, float]:
        r = httpx.get(f"{server.url}/metrics", timeout=30)  # no key needed
        assert r.status_code == 200
        return {
            s.name: s.value
            for fam in text_string_to_metric_families(r.text)
            for s in fam.samples
            if not s.labels or s.name.endswith(("_count", "_sum"))
        }

    server.wait_idle()
    before = scrape()
    out = http.post("/generate", json={"text": "Metrics please", "sampling_params": GREEDY}).json()
    server.wait_idle()
    after = scrape()
    gen = out["meta_info"]["completion_tokens"]
    gen_key = "radixlm_generation_tokens_total"
    assert after[gen_key] - before[gen_key] == gen
    prompt = out["meta_info"]["prompt_tokens"]
    assert after["radixlm_prompt_tokens_total"] - before["radixlm_prompt_tokens_total"] == prompt
    assert after["radixlm_requests_total"] - before["radixlm_requests_total"] == 1
    for hist in ("time_to_first_token", "e2e_request_latency"):
        name = f"radixlm_{hist}_seconds_count"
        assert after[name] - before[name] == 1
    assert after["radixlm_time_per_output_token_seconds_count"] >= 1
    pages = [after[f"radixlm_kv_pages_{k}"] for k in ("used", "cached", "free")]
    assert sum(pages) == after["radixlm_kv_pages_total"] == 384 and pages[0] == 0
    assert after["radixlm_num_requests_running"] == after["radixlm_num_requests_waiting"] == 0
    assert 0.0 <= after["radixlm_cache_hit_rate"] <= 1.0


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/generate"), ("POST", "/v1/completions"),
     ("GET", "/get_server_info"), ("POST", "/flush_cache")],
)  # fmt: skip
def test_api_key_required(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
        r = httpx.request(method, server.url + path, headers=headers, json={})
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_with_wrong_key_fails(server):
    import openai

    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_generate_max_new_tokens_zero_caches_the_prefix(http, server):
    """SGLang's frontend `cache_prefix` sends max_new_tokens=0: prefill, cache, return nothing."""
    prefix = "Prefix to cache for later requests, made long enough to fill pages. " * 6
    r = http.post("/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    page = server.info()["engine_stats"]["page_size"]
    prompt_tokens = out["meta_info"]["prompt_tokens"]
    body = {"text": prefix + "And then?", "sampling_params": {"max_new_tokens": 2}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert meta["cached_tokens"] >= prompt_tokens // page * page > 0
