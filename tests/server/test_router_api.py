"""The worker surface a cache-aware router and the Kubernetes endpoint picker read:
`/server_info`, `/model_info`, `/v1/loads`, `/get_load`, `/generate` with the router's fields,
and the model-server protocol gauges in `/metrics`."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def _gauges(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name not in out:
                out[s.name] = s.value
    return out


def test_server_info_is_flat_sglang_shape(
    http: httpx.Client, model_name: str, num_pages: int
) -> None:
    info = http.get("/server_info").json()
    assert info["served_model_name"] == model_name
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["max_total_tokens"] == num_pages * 16
    assert info["context_length"] == 8192
    assert info["version"]
    model = http.get("/model_info").json()
    assert model["is_generation"] is True
    assert model["architectures"] == ["LlamaForCausalLM"]
    assert model["model_type"] == "llama"
    assert 2 in model["eos_token_ids"]


def test_loads_follow_the_engine(http: httpx.Client, num_pages: int) -> None:
    body = http.get("/v1/loads", params={"include": "core"}).json()
    assert body["dp_rank_count"] == 1
    (load,) = body["loads"]
    assert load["max_total_num_tokens"] == num_pages * 16
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
    assert 0.0 <= load["token_usage"] <= 1.0
    assert load["max_running_requests"] >= 1
    (legacy,) = http.get("/get_load").json()
    assert legacy["num_reqs"] == 0


def test_generate_accepts_router_fields(http: httpx.Client, model_name: str) -> None:
    body = {
        "text": "Hello",
        "model": model_name,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "sampling_params": {"max_new_tokens": 2},
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    r = http.post("/generate", json={**body, "return_hidden_states": True})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "return_hidden_states"


def test_inference_gateway_gauges(http: httpx.Client, num_pages: int) -> None:
    g = _gauges(http)
    assert g["vllm:num_requests_waiting"] == g["radixlm_num_requests_waiting"]
    assert g["vllm:num_requests_running"] == g["radixlm_num_requests_running"]
    usage = g["vllm:kv_cache_usage_perc"]
    assert usage == g["vllm:gpu_cache_usage_perc"] == g["radixlm_kv_cache_usage_perc"]
    assert usage == g["radixlm_kv_pages_used"] / g["radixlm_kv_pages_total"]
    r = http.get("/metrics")
    assert f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{num_pages}"}} 1.0' in r.text
