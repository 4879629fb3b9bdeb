"""The public Engine API on the real default model: sync, stream, async, threads, abort, n>1,
seeds, stop strings, logprobs, bad input."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from radixlm import Engine, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The three primary colors are",
    "def is_prime(n):",
    "Water boils at",
    "My favourite book is",
]


@pytest.fixture(scope="module")
def engine(default_model_dir):
    with Engine(str(default_model_dir), dtype="float32", num_pages=512, debug_integrity=True) as e:
        yield e


def assert_clean(engine: Engine) -> None:
    assert engine.wait_idle(timeout=30)
    engine.check_integrity()
    s = engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.kv_pages_used == 0
    assert s.kv_pages_free + s.kv_pages_cached == s.kv_pages_total


def test_stream_deltas_concatenate_to_generate_text(engine):
    p = SamplingParams(max_new_tokens=24, temperature=0)
    full = engine.generate(PROMPTS[0], p)
    deltas = list(engine.stream(PROMPTS[0], p))
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.output_token_ids
    assert sum(d.finished for d in deltas) == 1 and deltas[-1].finished
    assert deltas[-1].finish_reason == full.finish_reason
    assert full.usage.prompt_tokens == len(engine.tokenize(PROMPTS[0]))
    assert full.usage.completion_tokens == len(full.output_token_ids)


def test_async_api_and_concurrent_asyncio_callers(engine):
    p = SamplingParams(max_new_tokens=12, temperature=0)
    expected = [r.text for r in engine.generate(PROMPTS, p)]

    async def main():
        results = await asyncio.gather(*(engine.generate_async(q, p) for q in PROMPTS))
        chunks = [d.text async for d in engine.stream_async(PROMPTS[1], p)]
        return [r.text for r in results], "".join(chunks)

    texts, streamed = asyncio.run(main())
    assert texts == expected
    assert streamed == expected[1]


def test_many_threads(engine):
    p = SamplingParams(max_new_tokens=10, temperature=0)
    expected = {q: engine.generate(q, p).output_token_ids for q in PROMPTS}
    got: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        got[i] = engine.generate(PROMPTS[i % 4], p).output_token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(got[i] == expected[PROMPTS[i % 4]] for i in range(12))
    assert_clean(engine)


def test_closing_a_stream_aborts_and_frees_pages(engine):
    it = engine.stream(
        PROMPTS[2], SamplingParams(max_new_tokens=500, temperature=0, ignore_eos=True)
    )
    next(it)
    next(it)
    it.close()
    assert_clean(engine)


def test_abort_by_request_id(engine):
    done = threading.Event()
    outs = []

    def sink(o):
        outs.append(o)
        if o.finished:
            done.set()

    rid = engine.submit(PROMPTS[3], SamplingParams(max_new_tokens=2000, ignore_eos=True), sink=sink)
    while not outs:
        threading.Event().wait(0.01)
    engine.abort(rid)
    assert done.wait(30)
    assert outs[-1].finish_reason == "abort"
    assert_clean(engine)


def test_n_branches_and_seed_reproducibility(engine):
    p = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234, n=3)
    a = engine.generate(PROMPTS[3], p)
    b = engine.generate(PROMPTS[3], p)
    assert len(a.outputs) == 3
    assert [o.output_token_ids for o in a.outputs] == [o.output_token_ids for o in b.outputs]
    assert len({tuple(o.output_token_ids) for o in a.outputs}) > 1  # branches sample independently
    # A seeded request gives the same tokens whatever else shares its batch.
    single = SamplingParams(max_new_tokens=16, temperature=0.8, seed=7)
    alone = engine.generate(PROMPTS[0], single).output_token_ids
    mixed = engine.generate(PROMPTS, [single, *[SamplingParams(max_new_tokens=16)] * 3])
    assert mixed[0].output_token_ids == alone
    assert_clean(engine)


def test_stop_strings_never_leak(engine):
    p = SamplingParams(max_new_tokens=40, temperature=0)
    full = engine.generate(PROMPTS[1], p).text
    stop = full[5:9]
    assert stop and stop.strip()
    deltas = list(
        engine.stream(PROMPTS[1], SamplingParams(max_new_tokens=40, temperature=0, stop=[stop]))
    )
    text = "".join(d.text for d in deltas)
    assert stop not in text and all(stop not in d.text for d in deltas)
    assert full.startswith(text) and text == full[: full.index(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_logprobs_match_transformers(engine, default_model_dir):
    from transformers import AutoModelForCausalLM

    p = SamplingParams(max_new_tokens=3, temperature=0, logprobs=True, top_logprobs=5)
    r = engine.generate(PROMPTS[2], p)
    lp = r.outputs[0].logprobs
    assert len(lp) == 3
    ids = engine.tokenize(PROMPTS[2])
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    assert lp[0].token_id == r.output_token_ids[0] == int(ref.argmax())
    assert lp[0].logprob == pytest.approx(float(ref.max()), abs=1e-3)
    top = lp[0].top
    assert [t for t, _ in top] == ref.topk(5).indices.tolist()
    assert all(a >= b for (_, a), (_, b) in zip(top, top[1:]))


def test_multibyte_text_never_splits(engine):
    deltas = list(
        engine.stream("用中文写一句话：", SamplingParams(max_new_tokens=30, temperature=0))
    )
    assert all("\ufffd" not in d.text for d in deltas)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(top_p=1.5),
        dict(max_new_tokens=0),
        dict(n=0),
        dict(top_k=-5),
        dict(stop=[""]),
    ],
)
def test_bad_sampling_params_raise_and_engine_keeps_serving(engine, bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
    assert engine.generate("Hi", SamplingParams(max_new_tokens=2)).finish_reason == "length"


def test_bad_prompts_raise_clearly(engine):
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate("", SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([1, 2, 10**9], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="context length"):
        engine.generate([5] * (engine.max_model_len + 1), SamplingParams(max_new_tokens=2))
    assert engine.generate("Hi", SamplingParams(max_new_tokens=2)).finish_reason == "length"
    assert_clean(engine)


def test_request_larger_than_the_pool_fails_alone(default_model_dir):
    with Engine(str(default_model_dir), dtype="float32", num_pages=4, page_size=4) as small:
        res = small.generate(
            ["Tell me a very long story about dragons.", "Hi"],
            [SamplingParams(max_new_tokens=100, ignore_eos=True), SamplingParams(max_new_tokens=2)],
        )
        assert res[0].finish_reason == "error" and "KV cache" in res[0].error
        assert res[1].finish_reason == "length"
        assert_clean(small)


def test_prompt_logprobs_match_transformers(engine, default_model_dir):
    from transformers import AutoModelForCausalLM

    ids = engine.tokenize("The quick brown fox jumps over the lazy dog because")
    engine.generate(ids[:8], SamplingParams(max_new_tokens=1))  # warm the cache with a prefix
    r = engine.generate(ids, SamplingParams(max_new_tokens=1, logprob_start_len=3))
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    ref = [float(lp[i - 1, ids[i]]) for i in range(3, len(ids))]
    assert r.prompt_logprobs == pytest.approx(ref, abs=1e-3)
    full = engine.generate(ids, SamplingParams(max_new_tokens=1, logprob_start_len=0))
    assert full.prompt_logprobs[0] is None
    assert full.prompt_logprobs[3:] == pytest.approx(ref, abs=1e-3)
