"""The OpenAI-compatible API, driven by the official `openai` client against the real server."""

from __future__ import annotations

import json
import math

import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name one fruit."}]


def test_models_lists_the_served_model(oai, server):
    models = oai.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    info = server.info()
    assert models[0].max_model_len == info["max_model_len"] == 8192  # type: ignore[attr-defined]


def test_completion_greedy_matches_native_generate(oai, http, model_name):
    r = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 0
    native = http.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0}},
    ).json()
    assert native["text"] == choice.text
    assert native["meta_info"]["completion_tokens"] == r.usage.completion_tokens


def test_completion_batch_of_prompts_and_token_ids(oai, tokenizer, model_name):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    single = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    batch = oai.completions.create(
        model=model_name, prompt=[PROMPT, "Water boils at"], max_tokens=6, temperature=0
    )
    by_ids = oai.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == single.choices[0].text == by_ids.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Water boils at"))


def test_completion_echo_and_stop(oai, model_name):
    r = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith(PROMPT)
    full = r.choices[0].text[len(PROMPT) :]
    assert len(full) > 2
    stop = full[2:4]
    s = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == full[: full.index(stop)]


def test_chat_completion(oai, model_name):
    r = oai.chat.completions.create(model=model_name, messages=CHAT, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = oai.chat.completions.create(
        model=model_name, messages=CHAT, max_completion_tokens=16, temperature=0
    )
    assert again.choices[0].message.content == msg.content
    # the whole prompt but its last partial page was cached by the first call
    assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 16


def test_chat_stream_usage_and_one_finish_reason(oai, model_name):
    ref = oai.chat.completions.create(model=model_name, messages=CHAT, max_tokens=16, temperature=0)
    stream = oai.chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f is not None] == [ref.choices[0].finish_reason]
    assert finishes[-1] is not None  # the finish reason comes with the choice's last chunk
    assert content == ref.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_n2_one_finish_reason_each(oai, model_name):
    stream = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=2, stream=True
    )
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes[c.index].append(c.finish_reason)
    assert all(len(f) == 1 for f in finishes.values()), finishes
    full = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=2
    )
    assert [c.text for c in full.choices] == [texts[0], texts[1]]


def test_n2_choices_and_usage(oai, model_name):
    r = oai.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=8, temperature=1.0, n=2, seed=11
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content is not None for c in r.choices)
    assert r.usage.completion_tokens >= 2
    assert r.usage.completion_tokens <= 16


def test_seed_reproducible(oai, model_name):
    def sample(seed: int) -> str:
        r = oai.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed
        )
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1  # sampling is not greedy


def test_completion_logprobs(oai, model_name):
    r = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == r.choices[0].text or r.choices[0].finish_reason == "stop"
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert math.isclose(value, max(top.values()), abs_tol=1e-5)
        assert tok in top
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(oai, model_name):
    r = oai.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    total = sum(math.exp(t.logprob) for t in content[0].top_logprobs)
    assert 0 < total <= 1.0 + 1e-5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token


def test_json_schema_output_validates(oai, server, model_name):
    import jsonschema

    assert server.info()["grammar_backend"] == "auto"
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    r = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Invent a person as JSON."}],
        max_tokens=64,
        temperature=0,
        response_format=rf,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # Streaming: the deltas concatenate to a valid document too.
    stream = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Invent another person as JSON."}],
        max_tokens=64,
        temperature=0.7,
        seed=3,
        response_format=rf,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_constraint_errors_are_400s_naming_the_field(oai, model_name):
    bad = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": bad}}
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(
            model=model_name, messages=CHAT, max_tokens=8, response_format=rf
        )
    err = exc.value.body
    assert err["param"] == "response_format" and "external reference" in err["message"]
    for extra in ({"regex": "(unclosed"}, {"ebnf": 'root ::= "a'}):
        with pytest.raises(openai.BadRequestError) as exc:
            oai.completions.create(model=model_name, prompt="x", max_tokens=4, extra_body=extra)
        assert exc.value.body["param"] == next(iter(extra))
    r = oai.completions.create(
        model=model_name, prompt="The answer is", max_tokens=4, extra_body={"regex": "[0-9]+"}
    )
    assert r.choices[0].text.isdigit()


def test_multi_turn_chat_reuses_shared_system_prompt(oai, server, tokenizer, model_name):
    words = "Our assistant answers briefly, politely and accurately about gardening topics. "
    system = (words * 60).strip()
    sys_msg = {"role": "system", "content": system}
    sys_ids = tokenizer.encode(
        tokenizer.apply_chat_template([sys_msg], tokenize=False), add_special_tokens=False
    )
    assert len(sys_ids) >= 500
    page = server.info()["engine_stats"]["page_size"]
    sys_full_pages = len(sys_ids) // page * page
    questions = ["How deep should I plant tulips?", "When do I prune roses?", "Is mulch good?"]
    for conv, question in enumerate(questions):
        messages = [sys_msg, {"role": "user", "content": question}]
        first = oai.chat.completions.create(
            model=model_name, messages=messages, max_tokens=8, temperature=0
        )
        cached = first.usage.prompt_tokens_details.cached_tokens
        if conv == 0:
            assert cached < sys_full_pages
        else:
            assert cached >= sys_full_pages, (conv, cached, sys_full_pages)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Thanks. One more tip?"},
        ]
        second = oai.chat.completions.create(
            model=model_name, messages=messages, max_tokens=8, temperature=0
        )
        turn1_full = first.usage.prompt_tokens // page * page
        assert second.usage.prompt_tokens_details.cached_tokens >= turn1_full


def test_logit_bias_is_applied(oai, model_name):
    """OpenAI clients send logit_bias: +100 on one token makes greedy decoding pick it."""
    r = oai.completions.create(
        model=model_name, prompt="Hello", max_tokens=3, temperature=0, logit_bias={"28": 100}
    )
    assert r.choices[0].text == ",,," and r.usage.completion_tokens == 3


def test_add_generation_prompt_is_honoured(oai, model_name, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]

    def prompt_tokens(**extra):
        r = oai.chat.completions.create(
            model=model_name, messages=msgs, max_tokens=1, extra_body=extra
        )
        return r.usage.prompt_tokens

    with_prompt = prompt_tokens()
    assert prompt_tokens(add_generation_prompt=True) == with_prompt

    def render(add: bool) -> int:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add)
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert with_prompt == render(True) and render(False) < render(True)
    assert prompt_tokens(add_generation_prompt=False) == render(False)
