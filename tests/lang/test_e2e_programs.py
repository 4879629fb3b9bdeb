"""Programs as users write them, on the real default model, on both backends (in-process
`Runtime` and `RuntimeEndpoint` to a real server). Greedy decoding, small max_tokens."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import pytest

import radixlm as sgl
from radixlm import SamplingParams

pytestmark = pytest.mark.slow


def wait_idle(backend: Any, timeout: float = 30.0) -> dict[str, Any]:
    """The backend's engine stats once nothing is running or waiting."""
    deadline = time.monotonic() + timeout
    while True:
        stats = backend.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {stats}")
        time.sleep(0.05)


FEW_SHOT = (
    "Q: What is the capital of Germany?\nA: Berlin\n\nQ: What is the capital of Italy?\nA: Rome\n\n"
)


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")


def test_few_shot_qa(backend, runtime):
    s = few_shot_qa.run(question="What is the capital of France?", backend=backend, temperature=0)
    assert s.error() is None
    assert "Paris" in s["answer"]
    # the program sent exactly this prompt: the engine, called directly, says the same
    prompt = FEW_SHOT + "Q: What is the capital of France?\nA:"
    direct = runtime.engine.generate(
        prompt, SamplingParams(max_new_tokens=8, stop=["\n"], temperature=0)
    )
    assert s["answer"] == direct.text
    assert s.text() == prompt + direct.text
    meta = s.get_meta_info("answer")
    assert meta["finish_reason"]["type"] == "stop" and meta["prompt_tokens"] > 20


@sgl.function
def multi_turn(s, questions):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    for i, question in enumerate(questions):
        with s.user():
            s += question
        with s.assistant():
            s += sgl.gen(f"answer_{i}", max_tokens=10)


def test_multi_turn_roles_use_the_chat_template(backend, runtime):
    s = multi_turn.run(questions=["What is 2+2?", "And 3+3?"], backend=backend, temperature=0)
    assert s.error() is None
    messages = s.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[3]["content"] == "And 3+3?"
    assert messages[2]["content"] == s["answer_0"].lstrip() and s["answer_0"].strip()
    # the state's text is the model's own chat template applied to the conversation
    tokenizer = runtime.get_tokenizer()
    assert s.text() == tokenizer.apply_chat_template(messages, tokenize=False)
    # the second turn's prompt extends the first: the radix cache serves the first turn
    assert s.get_meta_info("answer_1")["cached_tokens"] >= 32


JUDGE_PREFIX = (
    "Label each statement as True, False or Unknown.\n"
    "Statement: Water is wet.\nAnswer: True\n"
    "Statement: The sun is cold.\nAnswer: False\n"
    "Statement: My neighbour likes jazz.\nAnswer: Unknown\n"
)
VERDICTS = ["True", "False", "Unknown"]


@sgl.function
def judge(s, statement, method=sgl.token_length_normalized):
    s += JUDGE_PREFIX + "Statement: " + statement + "\nAnswer: "
    s += sgl.select("verdict", VERDICTS, choices_method=method)


@pytest.fixture(scope="module")
def hf_logprobs(default_model_dir):
    """Reference: logprob of each token of a prompt given the previous ones (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> list[float | None]:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]

    return logprobs


@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
    ids=lambda m: type(m).__name__,
)
def test_select_true_false_unknown(backend, runtime, hf_logprobs, method):
    statement = "Fire is hot."
    s = judge.run(statement=statement, method=method, backend=backend)
    assert s.error() is None
    meta = s.get_meta_info("verdict")
    # reference: each choice's tokens in the joint tokenization, scored by transformers
    prefix = JUDGE_PREFIX + "Statement: " + statement + "\nAnswer: "
    expected = []
    for choice in VERDICTS:
        full, head = runtime.tokenize(prefix + choice), runtime.tokenize(prefix)
        start = next(i for i, (a, b) in enumerate(zip(full, head + [-1])) if a != b)
        expected.append(hf_logprobs(full)[start:])
    got = [[t[0] for t in lps] for lps in meta["input_token_logprobs"]]
    assert [len(g) for g in got] == [len(e) for e in expected]
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, abs=2e-3)
    means = [sum(e) / len(e) for e in expected]
    if method is sgl.token_length_normalized:
        assert s["verdict"] == VERDICTS[means.index(max(means))]
    assert s["verdict"] in VERDICTS and s.text() == prefix + s["verdict"]


def test_select_prefix_is_computed_once(backend):
    wait_idle(backend)
    assert backend.flush_cache()
    before = backend.stats()
    s = judge.run(statement="Ice is frozen water.", backend=backend)
    assert s.error() is None
    after = wait_idle(backend)
    prefix_tokens = len(backend.tokenize(JUDGE_PREFIX + "Statement: Ice is frozen water.\n"))
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    # the prefix (one request), then each of the 3 choices: at most its partial page + itself
    assert prefix_tokens <= computed <= prefix_tokens + 3 * (before["page_size"] + 4)


@sgl.function
def arithmetic(s, a, b):
    s += "1 + 1 = 2\n2 + 2 = 4\n" + f"{a} + {b} = " + sgl.gen_int("sum", max_tokens=4)


def test_gen_int(backend):
    s = arithmetic.run(a=2, b=3, backend=backend, temperature=0)
    assert s.error() is None
    assert re.fullmatch(r"[-+]?[0-9]+", s["sum"]) and int(s["sum"]) == 5


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
}


@sgl.function
def extract(s, text):
    s += "Extract the person as JSON.\nText: " + text + "\n"
    s += "JSON: " + sgl.gen("person", max_tokens=40, json_schema=PERSON) + "\n"
    s += "Born (YYYY-MM-DD): " + sgl.gen("born", max_tokens=12, regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    s += "\nCode: " + sgl.gen("code", max_tokens=12, regex=r"\{\"id\": [0-9]{1,3}\}")


def test_json_by_schema_and_by_regex(backend):
    text = "Alice is 30 years old and lives in Paris. She was born on 1994-05-02."
    s = extract.run(text=text, backend=backend, temperature=0)
    assert s.error() is None
    person = json.loads(s["person"])
    jsonschema.validate(person, PERSON)
    assert person["name"] == "Alice" and person["age"] == 30
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", s["born"])
    assert json.loads(s["code"])["id"] >= 0


@sgl.function
def brainstorm(s, topic):
    s += FEW_SHOT * 4 + "Here are four short ideas about " + topic + ".\n"
    forks = s.fork(4)
    forks += lambda i: f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=6, stop="\n")
    forks.join()
    s += "Done."
    return [f.get_meta_info("idea") for f in forks]


def test_fork4_branches_share_the_prefix(backend):
    wait_idle(backend)
    assert backend.flush_cache()
    before = backend.stats()
    s = brainstorm.run(topic="gardening", backend=backend, temperature=0)
    assert s.error() is None
    after = wait_idle(backend)
    assert len(s["idea"]) == 4 and all(isinstance(x, str) for x in s["idea"])
    assert s.text().endswith("Done.")
    prefix = len(backend.tokenize(FEW_SHOT * 4 + "Here are four short ideas about gardening.\n"))
    page = before["page_size"]
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    # computed once (the fork's prefix request); each branch: its few tokens + a partial page
    assert prefix <= computed <= prefix + 4 * (page + 8), (computed, prefix)
    # every branch found the prefix's full pages in the cache
    assert all(meta["cached_tokens"] >= prefix - page for meta in s.ret_value), s.ret_value


@sgl.function
def story(s):
    s += "Once upon a time, in a small village by the sea,"
    s += sgl.gen("story", max_tokens=12)


def test_streaming_text_iter(backend):
    s = story.run(backend=backend, stream=True, temperature=0)
    chunks = list(s.text_iter("story"))
    assert s.error() is None
    assert len(chunks) >= 2  # incremental (a starved reader merges what arrived meanwhile)
    assert "".join(chunks) == s["story"]
    assert s.text() == "Once upon a time, in a small village by the sea," + s["story"]


def test_streaming_async_iter(backend):
    import asyncio

    s = story.run(backend=backend, stream=True, temperature=0)

    async def collect() -> list[str]:
        return [chunk async for chunk in s.text_async_iter("story")]

    chunks = asyncio.run(collect())
    assert len(chunks) >= 2 and "".join(chunks) == s["story"]


LONG_PREFIX = "You are a quiz master. Answer each question with a single word.\n\n" + FEW_SHOT * 8
CITIES = [
    "France", "Spain", "Portugal", "Japan", "China", "Egypt", "Peru", "Kenya",
    "Canada", "Mexico", "Chile", "Greece", "Norway", "Poland", "India", "Cuba",
]  # fmt: skip


@sgl.function
def capital(s, country):
    s += LONG_PREFIX + "Q: What is the capital of " + country + "?\nA:"
    s += sgl.gen("answer", max_tokens=4, stop="\n")


def test_run_batch_16_caches_the_constant_prefix_once(backend, capsys):
    wait_idle(backend)
    assert backend.flush_cache()
    before = backend.stats()
    states = capital.run_batch(
        [{"country": c} for c in CITIES], backend=backend, progress_bar=True, temperature=0
    )
    after = wait_idle(backend)
    assert all(s.error() is None for s in states)
    assert "16/16" in capsys.readouterr().err  # tqdm
    assert "Paris" in states[0]["answer"]
    prefix = len(backend.tokenize(LONG_PREFIX + "Q: What is the capital of"))
    page = before["page_size"]
    cached = [s.get_meta_info("answer")["cached_tokens"] for s in states]
    assert min(cached) >= prefix - page, (cached, prefix)
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    assert prefix <= computed <= prefix + 16 * (page + 12), (computed, prefix)


@sgl.function
def bad_then_good(s):
    s += "Hello" + sgl.gen("bad", max_tokens=4, temperature=-1.0)
    s += sgl.gen("never", max_tokens=4)


def test_bad_parameters_are_an_error_on_the_state_and_the_backend_keeps_serving(backend):
    s = bad_then_good.run(backend=backend)
    assert isinstance(s.error(), (ValueError, RuntimeError))
    assert "temperature" in str(s.error())
    with pytest.raises(KeyError, match="temperature"):
        s["never"]
    ok = story.run(backend=backend, temperature=0, max_new_tokens=4)
    assert ok.error() is None and ok["story"]
