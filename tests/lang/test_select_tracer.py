"""`select` and its choice methods, prefix tracing, and backend plumbing that needs no model."""

from __future__ import annotations

import json
import math
import time

import pytest
from fake_backend import FakeBackend, token_logprob

import radixlm as sgl
from radixlm.lang.chat_template import ChatTemplate, chatml
from radixlm.lang.choices import sample_index
from radixlm.lang.ir import DEFAULT_PARAMS, GenParams

CHOICES = [" True", " False", " Unknown"]


def _mean_lp(text: str) -> float:
    return sum(token_logprob(ord(c)) for c in text) / len(text)


@pytest.mark.parametrize(
    "method", [sgl.token_length_normalized, sgl.unconditional_likelihood_normalized]
)
def test_select_scores_choices_together_on_the_cached_prefix(method):
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += "Is the sky blue? Answer:" + sgl.select("ans", CHOICES, choices_method=method)

    s = prog.run(backend=be)
    assert s.error() is None
    prefix = "Is the sky blue? Answer:"
    # one prefix computation, then all choices in one scoring call
    assert be.calls[0] == ("cache", [ord(c) for c in prefix], None)
    kind, prompts, starts = be.calls[1]
    assert kind == "score" and prompts == [[ord(c) for c in prefix + ch] for ch in CHOICES]
    assert starts == [len(prefix)] * 3
    meta = s.get_meta_info("ans")
    expected = [_mean_lp(c) for c in CHOICES]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected)
    assert [len(x) for x in meta["input_token_logprobs"]] == [len(c) for c in CHOICES]
    if method is sgl.token_length_normalized:
        assert s["ans"] == CHOICES[max(range(3), key=expected.__getitem__)]
        assert be.kinds() == ["cache", "score"]
    else:
        # no context: the choice alone, first token unscored (counts as 0)
        kind, alone, starts = be.calls[2]
        assert alone == [[ord(c) for c in ch] for ch in CHOICES] and starts == [0, 0, 0]
        scores = [
            sum(token_logprob(ord(c)) for c in ch) / len(ch)
            - sum(token_logprob(ord(c)) for c in ch[1:]) / len(ch)
            for ch in CHOICES
        ]
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx(scores)
        assert s["ans"] == CHOICES[max(range(3), key=scores.__getitem__)]
    assert s.text() == prefix + s["ans"]


def test_choice_methods_on_handmade_logprobs():
    def lps(*values):
        return [[v, i, None] for i, v in enumerate(values)]

    choices = ["a", "ab", "c"]
    inputs = [lps(-1.0), lps(-1.0, -0.5), lps(-2.0)]
    normalized = [-1.0, -0.75, -2.0]
    kw = dict(choices=choices, normalized_prompt_logprobs=normalized, output_token_logprobs=[])
    assert sgl.token_length_normalized(input_token_logprobs=inputs, **kw).decision == "ab"
    greedy = sgl.greedy_token_selection(input_token_logprobs=inputs, **kw)
    # tie on the first token between a and ab; a is padded with its mean (-1) < -0.5
    assert greedy.decision == "ab"
    assert greedy.meta_info["greedy_logprob_matrix"][0] == [-1.0, -1.0]
    first_wins = [lps(-0.1, -9.0), lps(-0.2, -0.1), lps(-3.0)]
    assert sgl.greedy_token_selection(input_token_logprobs=first_wins, **kw).decision == "a"
    uncond = [lps(None), lps(None, -0.1), lps(None)]
    d = sgl.unconditional_likelihood_normalized(
        input_token_logprobs=inputs, unconditional_token_logprobs=uncond, **kw
    )
    assert d.scores == pytest.approx([-1.0, (-1.0 + (-0.5 + 0.1)) / 2, -2.0])
    assert d.decision == "ab"
    with pytest.raises(ValueError):
        sgl.unconditional_likelihood_normalized(input_token_logprobs=inputs, **kw)


def test_select_temperature_samples_from_the_scores():
    assert sample_index([0.0, math.log(3.0)], 1.0, 0.2) == 0
    assert sample_index([0.0, math.log(3.0)], 1.0, 0.3) == 1
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += "Pick:" + sgl.select("x", ["aaa", "bbb"], temperature=1e6)

    seen = {prog.run(backend=be)["x"] for _ in range(40)}
    assert seen == {"aaa", "bbb"}  # near-uniform at a huge temperature


def test_trace_prefix_stops_at_the_first_argument_or_generation():
    be = FakeBackend()
    system = "You are a careful assistant who answers with one word. " * 2

    @sgl.function
    def chat(s, question):
        s += sgl.system(system)
        with s.user():
            s += "Question: "
            s += question
        s += sgl.assistant(sgl.gen("answer"))

    prefix = chat.trace_prefix(be)
    assert prefix == chatml([{"role": "system", "content": system}]) + (
        "<|im_start|>user\nQuestion: "
    )
    assert be.calls == []  # tracing never reaches the model

    @sgl.function
    def fstring(s, topic, n):
        s += "Constant intro. "
        s += f"Write about {topic}."

    assert fstring.trace_prefix(be) == "Constant intro. "

    @sgl.function
    def branchy(s, flag):
        s += "A"
        if flag:
            s += "B"

    assert branchy.trace_prefix(be) == "A"

    @sgl.function
    def gen_first(s, q):
        s += "Before " + sgl.gen("x") + q

    assert gen_first.trace_prefix(be) == "Before "
    assert be.calls == []


def test_run_batch_precaches_a_long_constant_prefix_once():
    be = FakeBackend()
    few_shot = "Q: 1+1?\nA: 2\nQ: 2+2?\nA: 4\nQ: 3+3?\nA: 6\nQ: 4+4?\nA: 8\nQ: 5+5?\nA: 10\n"

    @sgl.function
    def prog(s, q):
        s += few_shot + "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=3)

    states = prog.run_batch([{"q": f"{i}+{i}?"} for i in range(6)], backend=be, num_threads=3)
    assert all(s.error() is None for s in states)
    assert be.calls[0] == ("cache", few_shot + "Q: ", None)
    assert be.kinds().count("cache") == 1 and be.kinds().count("gen") == 6

    short = FakeBackend()

    @sgl.function
    def tiny(s, q):
        s += "Q: " + q + sgl.gen("a")

    tiny.run_batch([{"q": "a"}, {"q": "b"}], backend=short)
    assert "cache" not in short.kinds()  # too short to be worth a request


def test_chat_template_from_a_tokenizer_like_object():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            text = "<s>" if messages[0]["role"] != "system" else ""
            return text + "".join(f"[{m['role']}]{m['content']}[/]" for m in messages)

    t = ChatTemplate.from_tokenizer(Tok())
    assert t.prefix_and_suffix("user", []) == ("<s>[user]", "[/]")
    assert t.prefix_and_suffix("assistant", [{"role": "user", "content": "hi"}]) == (
        "[assistant]",
        "[/]",
    )
    assert ChatTemplate(None).prefix_and_suffix("user", []) == (
        "<|im_start|>user\n",
        "<|im_end|>\n",
    )


def test_unreachable_endpoint_is_an_error_on_the_state_quickly():
    backend = sgl.RuntimeEndpoint("http://127.0.0.1:9", connect_timeout=2.0)

    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("x", max_tokens=4)
        s += sgl.gen("y")

    t0 = time.monotonic()
    s = prog.run(backend=backend)
    assert isinstance(s.error(), ConnectionError)
    assert "127.0.0.1:9" in str(s.error())
    assert time.monotonic() - t0 < 10
    with pytest.raises(KeyError, match="cannot reach"):
        s["y"]
    backend.shutdown()


def test_endpoint_request_body():
    ep = sgl.RuntimeEndpoint("http://127.0.0.1:9")
    p = GenParams(max_new_tokens=8, stop=["\n"], json_schema={"type": "object"}).merged(
        DEFAULT_PARAMS
    )
    body = ep._body("hi", p, stream=False)
    sp = body["sampling_params"]
    assert body["text"] == "hi" and sp["max_new_tokens"] == 8 and sp["stop"] == ["\n"]
    assert json.loads(sp["json_schema"]) == {"type": "object"}
    assert "stop_token_ids" not in sp and "return_logprob" not in body
    ep.shutdown()


def test_runtime_accepts_sglang_argument_names():
    from radixlm.lang.backend.runtime import engine_kwargs

    assert engine_kwargs(
        {
            "mem_fraction_static": 0.1,
            "disable_radix_cache": True,
            "random_seed": 3,
            "context_length": 2048,
            "tp_size": 1,
            "log_level": "error",
            "chunked_prefill_size": -1,
            "dtype": "float32",
        }
    ) == {
        "kv_memory_fraction": 0.1,
        "enable_prefix_caching": False,
        "seed": 3,
        "max_model_len": 2048,
        "chunked_prefill_size": None,
        "dtype": "float32",
    }
    with pytest.raises(ValueError, match="tp_size"):
        engine_kwargs({"tp_size": 2})


def test_import_radixlm_stays_cheap():
    import subprocess
    import sys

    code = (
        "import sys, radixlm as sgl\n"
        "sgl.gen, sgl.function, sgl.user, sgl.select, sgl.RuntimeEndpoint, sgl.var_scope\n"
        "assert 'torch' not in sys.modules, 'the frontend imported torch'\n"
        "from radixlm.runtime.engine import Engine\n"
        "assert sgl.Engine is Engine and sgl.Runtime.__name__ == 'Runtime'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
