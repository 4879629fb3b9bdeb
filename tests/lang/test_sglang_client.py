"""SGLang's own frontend (the real `sglang` package, unmodified) against `radixlm serve`.

Every program is written once and built twice: with `sglang` (run through
`sglang.RuntimeEndpoint` against the live server of tests/lang) and with `radixlm` (run on the
in-process `Runtime`); greedy decoding makes the two results comparable exactly. The server is
the session's tests/lang server (`server_url`), so this module starts no process of its own.
"""

from __future__ import annotations

import json
import re
from types import ModuleType
from typing import Any

import pytest

import radixlm

pytestmark = pytest.mark.slow
sglang = pytest.importorskip("sglang", reason="the test extra installs sglang (scripts/setup.sh)")

API_KEY = "lang-test-key"  # tests/lang/conftest.py's server
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
FEW_SHOT = (
    "Q: What is the capital of Germany?\nA: Berlin\n\nQ: What is the capital of Italy?\nA: Rome\n\n"
)


def build(lib: ModuleType) -> dict[str, Any]:
    """The same programs, decorated by `lib` (sglang or radixlm)."""

    @lib.function
    def qa(s, question):
        s += FEW_SHOT + "Q: " + question + "\nA:" + lib.gen("answer", max_tokens=12, stop="\n")

    @lib.function
    def ip(s):
        s += "The IP address of the local host is "
        s += lib.gen("ip", max_tokens=16, regex=r"(\d{1,3}\.){3}\d{1,3}")

    @lib.function
    def person(s):
        s += "Invent a person as JSON.\nJSON: "
        s += lib.gen("person", max_tokens=40, json_schema=json.dumps(SCHEMA))

    @lib.function
    def pick(s, method):
        s += "Q: Is Paris the capital of France? Answer True, False or Unknown.\nA:"
        s += lib.select("check", ["True", "False", "Unknown"], choices_method=method)

    @lib.function
    def chat(s, questions):
        s += lib.system("You are a helpful assistant. Answer in one short sentence.")
        for i, question in enumerate(questions):
            s += lib.user(question)
            s += lib.assistant(lib.gen(f"answer_{i}", max_tokens=10))

    @lib.function
    def branches(s, topic):
        s += "Three short ideas about " + topic + ".\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Idea {i + 1}:" + lib.gen("idea", max_tokens=6)
        forks.join()
        s += "\nBest idea:" + lib.gen("best", max_tokens=6)

    @lib.function
    def story(s):
        s += "Once upon a time, in a small village,"
        s += lib.gen("story", max_tokens=12)

    @lib.function
    def count(s):
        s += "Count: 1, 2, 3, 4, 5, 6, 7,"
        s += lib.gen("rest", max_tokens=24, stop_regex=r"1\d")

    return locals()


SG = build(sglang)
RX = build(radixlm)
METHODS = [
    "token_length_normalized",
    "greedy_token_selection",
    "unconditional_likelihood_normalized",
]


@pytest.fixture(scope="module")
def sg_backend(server_url: str) -> Any:
    # SGLang guesses the chat template from the model path; SmolLM2 speaks ChatML.
    return sglang.RuntimeEndpoint(server_url, api_key=API_KEY, chat_template_name="chatml")


def both(name: str, sg_backend: Any, runtime: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Run program `name` on SGLang's client and on the in-process Runtime (greedy)."""
    sg = SG[name].run(backend=sg_backend, temperature=0, **kwargs)
    rx = RX[name].run(backend=runtime, temperature=0, **kwargs)
    assert rx.error() is None
    return sg, rx


def test_gen_with_stop(sg_backend, runtime):
    sg, rx = both("qa", sg_backend, runtime, question="What is the capital of France?")
    assert "Paris" in sg["answer"] and "\n" not in sg["answer"]
    assert sg["answer"] == rx["answer"] and sg.text() == rx.text()
    meta = sg.get_meta_info("answer")
    assert meta["finish_reason"] == {"type": "stop", "matched": "\n"}


def test_gen_with_regex(sg_backend, runtime):
    sg, rx = both("ip", sg_backend, runtime)
    assert re.fullmatch(r"(\d{1,3}\.){3}\d{1,3}", sg["ip"])
    assert sg["ip"] == rx["ip"]


def test_gen_with_json_schema(sg_backend, runtime):
    jsonschema = pytest.importorskip("jsonschema")
    sg, rx = both("person", sg_backend, runtime)
    jsonschema.validate(json.loads(sg["person"]), SCHEMA)
    assert sg["person"] == rx["person"]


@pytest.mark.parametrize("method", METHODS)
def test_select_every_choices_method(sg_backend, runtime, method):
    sg = SG["pick"].run(
        backend=sg_backend, method=getattr(sglang.lang.choices, method), temperature=0
    )
    rx = RX["pick"].run(backend=runtime, method=getattr(radixlm, method), temperature=0)
    assert sg.error() is None
    assert sg["check"] in ("True", "False", "Unknown")
    assert sg["check"] == rx["check"]
    sg_meta, rx_meta = sg.get_meta_info("check"), rx.get_meta_info("check")
    # Each choice is one token here. SGLang's frontend asks for the prompt's logprobs from two
    # tokens before the choice ("A", ":") and averages them in; the choice token's own logprob
    # is the one radixlm's in-process select scored.
    rows = sg_meta["input_token_logprobs"]
    assert [len(r) for r in rows] == [3, 3, 3] and all(r[0][0] is not None for r in rows)
    assert [r[-1][2] for r in rows] == ["True", "False", "Unknown"]
    got = [r[-1][0] for r in rows]
    assert got == pytest.approx(rx_meta["normalized_prompt_logprobs"], abs=2e-3)


def test_multi_turn_roles_with_chat_template(sg_backend, runtime):
    questions = ["What is 2+2?", "And 3+3?"]
    sg, rx = both("chat", sg_backend, runtime, questions=questions)
    assert sg.text().startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert sg.text() == rx.text()
    assert [sg["answer_0"], sg["answer_1"]] == [rx["answer_0"], rx["answer_1"]]
    assert sg.get_meta_info("answer_1")["cached_tokens"] >= 32  # the first turn is reused


def test_fork_join(sg_backend, runtime):
    sg, rx = both("branches", sg_backend, runtime, topic="gardening")
    assert len(sg["idea"]) == 3 and all(sg["idea"])
    assert sg["idea"] == rx["idea"] and sg["best"] == rx["best"]
    assert sg.text() == rx.text()


def test_run_batch(sg_backend, runtime):
    args = [{"question": q} for q in ("What is the capital of France?", "What is 1+1?")]
    sg = SG["qa"].run_batch(args, backend=sg_backend, temperature=0, num_threads=2)
    rx = RX["qa"].run_batch(args, backend=runtime, temperature=0, progress_bar=False)
    assert [s["answer"] for s in sg] == [s["answer"] for s in rx]
    assert "Paris" in sg[0]["answer"]


def test_streaming_text_iter(sg_backend, runtime):
    state = SG["story"].run(backend=sg_backend, temperature=0, stream=True)
    chunks = list(state.text_iter("story"))
    rx = RX["story"].run(backend=runtime, temperature=0)
    assert len(chunks) > 1 and "".join(chunks) == rx["story"] == state["story"]


def test_stop_regex(sg_backend, runtime, endpoint):
    sg, rx = both("count", sg_backend, runtime)
    own = RX["count"].run(backend=endpoint, temperature=0)  # radixlm's own RuntimeEndpoint
    assert sg["rest"] == rx["rest"] == own["rest"]
    assert re.search(r"1\d", sg["rest"]) and sg["rest"].endswith(re.findall(r"1\d", sg["rest"])[0])
    assert sg.get_meta_info("rest")["finish_reason"] == {"type": "stop", "matched": r"1\d"}
    assert sg["rest"].count("1") == 1  # "10": nothing after the first match
