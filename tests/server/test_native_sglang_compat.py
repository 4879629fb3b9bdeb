"""`/generate` and friends against SGLang 0.5.x's contract, over httpx: logprob layouts,
`logprob_start_len` (incl. -1), fields accepted only at their defaults, refused fields (a 400
naming them), `stop_regex` on the engine, `/encode`, and the info aliases."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from radixlm.server.protocol import NATIVE_DEFAULT_ONLY

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Italy is"
GREEDY = {"max_new_tokens": 6, "temperature": 0}


def gen(http, **body: Any) -> Any:
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def is_entry(e: Any, with_text: bool, nullable: bool = False) -> bool:
    lp, tid, text = e
    ok_lp = (lp is None and nullable) or (isinstance(lp, float) and lp <= 0.0)
    return ok_lp and isinstance(tid, int) and (isinstance(text, str) if with_text else text is None)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT, add_special_tokens=False)


# ---- logprob layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_text", [False, True])
def test_output_logprobs_only_by_default(http, tokenizer, with_text):
    out = gen(http, return_logprob=True, return_text_in_logprobs=with_text)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output tokens only
    lps = meta["output_token_logprobs"]
    assert len(lps) == meta["output_token_logprobs_length"] == meta["completion_tokens"]
    assert [e[1] for e in lps] == out["output_ids"]
    assert all(is_entry(e, with_text) for e in lps)
    if with_text:
        assert [e[2] for e in lps] == [tokenizer.decode([t]) for t in out["output_ids"]]
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta


def test_logprob_start_len_zero_k_and_prompt_len(http, prompt_ids):
    full = gen(http, return_logprob=True, logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in full] == prompt_ids
    assert full[0][0] is None and all(is_entry(e, False) for e in full[1:])
    k = len(prompt_ids) - 2
    tail = gen(http, return_logprob=True, logprob_start_len=k)["meta_info"]["input_token_logprobs"]
    # position k is predicted by the tokens before it: a real value, not null
    assert [e[1] for e in tail] == prompt_ids[k:] and tail[0][0] is not None
    assert [e[0] for e in tail] == pytest.approx([e[0] for e in full[k:]], abs=1e-4)
    end = gen(http, return_logprob=True, logprob_start_len=len(prompt_ids))["meta_info"]
    assert end["input_token_logprobs"] == [] and end["output_token_logprobs"]
    r = http.post(
        "/generate",
        json={"text": PROMPT, "return_logprob": True, "logprob_start_len": len(prompt_ids) + 1},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"


def test_logprob_start_len_ignored_without_return_logprob(http):
    meta = gen(http, logprob_start_len=0, top_logprobs_num=3)["meta_info"]
    assert "input_token_logprobs" not in meta and "output_token_logprobs" not in meta


@pytest.mark.parametrize("with_text", [False, True])
def test_top_logprobs_layout(http, tokenizer, prompt_ids, with_text):
    out = gen(
        http,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=with_text,
    )
    meta = out["meta_info"]
    inp, itop = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(itop) == len(inp) == len(prompt_ids) and itop[0] is None
    for entry, top in zip(inp[1:], itop[1:]):
        assert len(top) == 3 and all(is_entry(e, with_text) for e in top)
        values = [e[0] for e in top]
        assert values == sorted(values, reverse=True) and entry[0] <= values[0] + 1e-5
        if entry[1] in [e[1] for e in top]:
            assert entry[0] == pytest.approx(next(e[0] for e in top if e[1] == entry[1]), abs=1e-4)
    out_lps, otop = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(otop) == len(out_lps) == len(out["output_ids"])
    for entry, top in zip(out_lps, otop):
        assert len(top) == 3 and all(is_entry(e, with_text) for e in top)
        assert top[0][1] == entry[1] and top[0][0] == pytest.approx(entry[0], abs=1e-4)  # greedy
        if with_text:
            assert top[0][2] == tokenizer.decode([top[0][1]])


def test_prefill_only_request_scores_the_whole_prompt(http, prompt_ids):
    """`max_new_tokens: 0` + `return_logprob` without a start: SGLang's frontend
    (`unconditional_likelihood_normalized`) reads the whole prompt's logprobs."""
    r = http.post(
        "/generate",
        json={"input_ids": [prompt_ids], "sampling_params": {"max_new_tokens": 0},
              "return_logprob": True},
    )  # fmt: skip
    (out,) = r.json()
    meta = out["meta_info"]
    assert out["text"] == "" and out["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt_ids
    assert meta["input_token_logprobs"][0][0] is None


def test_per_prompt_logprob_fields(http, prompt_ids):
    body = {
        "text": [PROMPT, PROMPT],
        "sampling_params": GREEDY,
        "return_logprob": [True, False],
        "logprob_start_len": [3, -1],
        "top_logprobs_num": [2, 0],
    }
    a, b = http.post("/generate", json=body).json()
    assert [e[1] for e in a["meta_info"]["input_token_logprobs"]] == prompt_ids[3:]
    assert len(a["meta_info"]["output_top_logprobs"][0]) == 2
    assert "output_token_logprobs" not in b["meta_info"]
    r = http.post("/generate", json={**body, "return_logprob": [True]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_logprob"


# ---- fields: accepted at null/default, refused otherwise ----------------------------------------

SGLANG_NULLS = {
    "max_new_tokens": 4, "stop": None, "stop_token_ids": None, "stop_regex": None,
    "temperature": None, "top_p": None, "top_k": None, "min_p": None,
    "frequency_penalty": None, "presence_penalty": None, "repetition_penalty": None,
    "min_new_tokens": None, "n": None, "beam_width": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "ignore_eos": None, "skip_special_tokens": None,
    "spaces_between_special_tokens": None, "no_stop_trim": None, "stream_interval": None,
    "logit_bias": None, "sampling_seed": None, "custom_params": None, "watermark": None,
}  # fmt: skip


def test_every_sglang_sampling_field_accepted_at_null(http):
    """SGLang treats null as the default for every field: so does radixlm (null temperature is
    1.0, i.e. sampling; pin the seed so the two runs agree)."""
    a = gen(http, sampling_params={**SGLANG_NULLS, "sampling_seed": 7})
    b = gen(http, sampling_params={"max_new_tokens": 4, "sampling_seed": 7})
    assert a["text"] == b["text"] and a["meta_info"]["completion_tokens"] == 4
    # SGLang's frontend's own defaults, and its "whole vocabulary" top_k
    c = gen(
        http,
        sampling_params={**GREEDY, "top_k": 1 << 30, "spaces_between_special_tokens": True,
                         "beam_width": 1, "logit_bias": {}, "custom_params": {}, "json_schema": "",
                         "stream_interval": 2},
        session_id="s1", routing_key="k", conversation_id="c", log_metrics=False,
        image_data=None, lora_path=None, return_hidden_states=False, modalities=[],
    )  # fmt: skip
    assert c["text"] == gen(http)["text"]


def _non_default(name: str) -> Any:
    return {
        "sampling_params.spaces_between_special_tokens": False,
        "sampling_params.beam_width": 2,
        "sampling_params.custom_params": {"a": 1},
        "sampling_params.watermark": {"key": 1},
    }.get(name, "x")


@pytest.mark.parametrize("name", sorted(NATIVE_DEFAULT_ONLY))
def test_non_default_values_are_refused_naming_the_field(http, name):
    value = _non_default(name)
    body: dict[str, Any] = {"text": PROMPT, "sampling_params": dict(GREEDY)}
    if name.startswith("sampling_params."):
        body["sampling_params"][name.split(".", 1)[1]] = value
    else:
        body[name] = value
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name


def test_unknown_field_is_refused(http):
    r = http.post("/generate", json={"text": "x", "sampling_params": {"stop_strs": ["a"]}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.stop_strs"


def test_logit_bias_is_applied(http):
    """SGLang's `sampling_params.logit_bias` (token id -> bias), as on the OpenAI API: +100 on
    one token makes greedy decoding pick it; out-of-range values are 400s naming the field."""
    sp = {"max_new_tokens": 3, "temperature": 0, "logit_bias": {"28": 100}}
    out = gen(http, sampling_params=sp)
    assert out["output_ids"] == [28, 28, 28] and out["text"] == ",,,"
    r = http.post(
        "/generate", json={"text": "x", "sampling_params": {**sp, "logit_bias": {"5": 500}}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.logit_bias"


def test_max_new_tokens_null_runs_to_a_natural_end(http):
    out = gen(http, sampling_params={"max_new_tokens": None, "regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", out["text"])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


# ---- stop_regex on the engine --------------------------------------------------------------------


def first_match_end(text: str, pattern: str) -> int | None:
    """Reference: the shortest prefix of `text` that contains a match."""
    for end in range(1, len(text) + 1):
        if re.search(pattern, text[:end]):
            return end
    return None


COUNT = "Count to ten: 1, 2, 3, 4, 5, 6,"
COUNT_PARAMS = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def count_text(http) -> str:
    """The greedy continuation of COUNT without any stop."""
    body = {"text": COUNT, "sampling_params": COUNT_PARAMS}
    return http.post("/generate", json=body).json()["text"]


@pytest.mark.parametrize("pattern", [r"\d", r"9, 1\d", r"\b1[0-9]\b"])
def test_stop_regex_cuts_right_after_the_first_match(http, count_text, pattern):
    full = count_text
    end = first_match_end(full, pattern)
    assert end is not None, full  # the prompt is chosen so every pattern matches
    body = {"text": COUNT, "sampling_params": {**COUNT_PARAMS, "stop_regex": [pattern]}}
    out = http.post("/generate", json=body).json()
    assert out["text"] == full[:end]  # the match is kept; nothing after it
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    # streaming: cumulative texts only grow, and never past the final text
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    texts = [e["text"] for e in events]
    assert texts[-1] == full[:end] and all(texts[-1].startswith(t) for t in texts)


def test_stop_regex_and_stop_string_first_to_complete_wins(http, count_text):
    digit = re.search(r"\d", count_text)
    assert digit is not None and digit.start() > 0
    sp = {**COUNT_PARAMS, "stop_regex": r"\d", "stop": count_text[: digit.start()]}
    out = http.post("/generate", json={"text": COUNT, "sampling_params": sp}).json()
    reason = out["meta_info"]["finish_reason"]["matched"]
    assert reason == sp["stop"] and out["text"] == ""  # the stop string completes first


@pytest.mark.parametrize(
    ("value", "fragment"), [("(", "invalid pattern"), ("a*", "empty string"), (["x"] * 33, "32")]
)
def test_bad_stop_regex_is_a_400(http, value, fragment):
    body = {"text": "x", "sampling_params": {"stop_regex": value}}
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "sampling_params.stop_regex"


# ---- /encode and the other routes ----------------------------------------------------------------


def test_encode(http):
    r = http.post("/encode", json={"text": "hello"})
    assert r.status_code == 400
    assert "does not appear to be an embedding model" in r.json()["error"]["message"]
    r = http.post("/encode", json={"text": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
    r = http.post("/encode", json={"text": "hi", "image_data": "a.png"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"
    r = http.post("/encode", json={"text": "hi", "input_ids": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"


def test_info_aliases_and_abort_fields(http):
    for path in ("/model_info", "/get_model_info"):
        info = http.get(path).json()
        assert info["is_generation"] is True and info["model_path"]
    assert http.get("/server_info").json()["model_path"]
    info = http.get("/get_server_info", params={"check_integrity": "true"}).json()
    assert info["kv_integrity"] == "ok"
    assert info["tp_size"] == 1  # SGLang's top-level key
    assert info["weight_bytes"] > 0 and info["linears"]
    r = http.post("/abort_request", json={"rid": "none", "abort_message": "bye"})
    assert r.status_code == 200 and r.json()["found"] is False
