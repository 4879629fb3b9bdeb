"""The second KV tier through the engine (tiny random model, float32): greedy output identical
whether a prefix came from the pool, the tier or recomputation; warm restart over a storage
dir; corrupt / truncated / foreign page files; a full disk; no page leaks; flush clears both."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from radixlm import Engine, SamplingParams
from radixlm.radix import HiCache
from radixlm.radix import tier as tier_mod

PS = 4
# top-5 logprobs too: a random model's greedy tokens alone can hide a wrong K/V page
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, top_logprobs=5)

Out = list[tuple[int, list[tuple[int, float]]]]


def _engine(model: Path, **kw: object) -> Engine:
    args: dict[str, object] = dict(
        dtype="float32", num_pages=16, page_size=PS, max_model_len=128, debug_integrity=True
    )
    args.update(kw)
    return Engine(str(model), **args)


def _prompts() -> list[Out]:
    """Three 40-token prompts sharing a 16-token system prefix: together they overflow a
    16-page pool once they are cached, so the first ones are evicted to the tier."""
    system = list(range(100, 116))
    return [system + [200 + 30 * i + j for j in range(24)] for i in range(3)]


def _run(eng: Engine, prompt: list[int]) -> tuple[Out, int]:
    res = eng.generate(prompt, GREEDY)
    out = [(t.token_id, t.top) for t in res.outputs[0].logprobs]
    return out, res.usage.cached_tokens


def _same(a: Out, b: Out) -> bool:
    """Same greedy tokens and top-5 ids; top-5 logprobs equal up to float32 batching noise."""
    for (ta, topa), (tb, topb) in zip(a, b, strict=True):
        if ta != tb or [i for i, _ in topa] != [i for i, _ in topb]:
            return False
        if any(abs(x - y) > 1e-4 for (_, x), (_, y) in zip(topa, topb, strict=True)):
            return False
    return True


def _assert_no_leak(eng: Engine) -> None:
    eng.wait_idle()
    eng.check_integrity()
    s = eng.stats()
    assert s.kv_pages_used == 0
    assert eng.flush_cache()
    assert eng.stats().kv_pages_free == s.kv_pages_total


def _reference(model: Path) -> list[Out]:
    with _engine(model, enable_prefix_caching=False, num_pages=64) as eng:
        return [_run(eng, p)[0] for p in _prompts()]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[Out]:
    return _reference(tiny_llama_dir)


@pytest.mark.parametrize("storage", ["host", "file"])
def test_tier_hits_match_recomputation(
    tiny_llama_dir: Path, tmp_path: Path, reference: list[Out], storage: str
) -> None:
    kw: dict[str, object] = {"enable_hierarchical_cache": True}
    if storage == "file":
        kw["hicache_storage_dir"] = str(tmp_path / "tier")
    with _engine(tiny_llama_dir, **kw) as eng:
        prompts = _prompts()
        for p, ref in zip(prompts, reference, strict=True):
            assert _same(_run(eng, p)[0], ref)  # computed (the system prefix from the pool)
        assert eng.stats().hicache_stored_pages > 0  # the first prompts were evicted
        out, cached = _run(eng, prompts[0])  # its pages come back from the tier
        assert _same(out, reference[0])
        s = eng.stats()
        assert s.hicache_hit_tokens > 0 and s.hicache_loaded_pages > 0
        assert cached >= 32  # usage counts tier hits (whole pages of the 39 usable tokens)
        assert s.hicache_load_seconds > 0
        assert eng.parts.hicache.stats().prefetched_pages > 0  # read in the background
        _assert_no_leak(eng)
        assert eng.stats().hicache_pages == 0  # flush clears the tier too
        if storage == "file":
            assert not list((tmp_path / "tier").glob("*/rank0/*.kv"))


def test_warm_restart_reports_cached_tokens(
    tiny_llama_dir: Path, tmp_path: Path, reference: list[Out]
) -> None:
    store = str(tmp_path / "tier")
    prompts = _prompts()
    with _engine(tiny_llama_dir, hicache_storage_dir=store) as eng:
        assert _same(_run(eng, prompts[0])[0], reference[0])
    # shutdown wrote the tree's pages back
    with _engine(tiny_llama_dir, hicache_storage_dir=store) as eng:
        assert eng.stats().hicache_pages >= 9
        out, cached = _run(eng, prompts[0])
        assert _same(out, reference[0]) and cached >= 36
        out, cached = _run(eng, prompts[1])  # shares the 16-token system prefix
        assert _same(out, reference[1]) and cached >= 16
        _assert_no_leak(eng)


def _page_files(store: str) -> list[Path]:
    return sorted(Path(store).glob("*/rank0/*.kv"))


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_damaged_files_are_never_served(
    tiny_llama_dir: Path, tmp_path: Path, reference: list[Out], damage: str
) -> None:
    store = str(tmp_path / "tier")
    prompt = _prompts()[0]
    with _engine(tiny_llama_dir, hicache_storage_dir=store) as eng:
        _run(eng, prompt)
    files = _page_files(store)
    assert len(files) >= 9
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "corrupt":
            data[-5] ^= 0xFF  # a flipped payload byte: the checksum fails on read
        elif damage == "truncated":
            data = data[: len(data) // 2]  # dropped at re-index (length mismatch)
        else:
            data[8] ^= 0xFF  # another store's identity: dropped at re-index
        path.write_bytes(bytes(data))
    with _engine(tiny_llama_dir, hicache_storage_dir=store) as eng:
        out, cached = _run(eng, prompt)
        assert _same(out, reference[0])
        assert cached == 0  # nothing served: recomputed
        s = eng.stats()
        assert s.hicache_hit_tokens == 0
        assert s.hicache_dropped_pages >= 1
        _assert_no_leak(eng)


def test_other_model_identity_is_ignored(
    tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = str(tmp_path / "tier")
    prompt = _prompts()[0]
    with _engine(tiny_llama_dir, hicache_storage_dir=store) as eng:
        _run(eng, prompt)
    with caplog.at_level(logging.INFO, logger="radixlm.radix.tier"):
        with _engine(tiny_llama_dir, hicache_storage_dir=store, page_size=8) as eng:
            assert eng.stats().hicache_pages == 0
            assert _run(eng, prompt)[1] == 0
    assert any("another model" in r.getMessage() for r in caplog.records)


def test_full_disk_keeps_serving_and_logs_once(
    tiny_llama_dir: Path,
    tmp_path: Path,
    reference: list[Out],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def full(self: object, key: bytes, payload: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_mod.FileTierStore, "_write_file", full)
    with caplog.at_level(logging.ERROR, logger="radixlm.radix.tier"):
        with _engine(tiny_llama_dir, hicache_storage_dir=str(tmp_path / "tier")) as eng:
            for _ in range(2):
                for p, ref in zip(_prompts(), reference, strict=True):
                    assert _same(_run(eng, p)[0], ref)
            eng.parts.hicache.close()
            s = eng.stats()
            assert s.hicache_write_errors > 1 and s.hicache_pages == 0
            _assert_no_leak(eng)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_write_through_survives_a_crash(
    tiny_llama_dir: Path,
    tmp_path: Path,
    reference: list[Out],
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
) -> None:
    """No write-back at shutdown (as after a kill -9): only write-through kept the pages."""
    monkeypatch.setattr(HiCache, "write_back_all", lambda self: 0)
    store = str(tmp_path / "tier")
    prompt = _prompts()[0]
    kw = {"hicache_storage_dir": store, "hicache_write_policy": policy}
    with _engine(tiny_llama_dir, **kw) as eng:
        _run(eng, prompt)
        assert (eng.stats().hicache_stored_pages > 0) == (policy == "write_through")
    with _engine(tiny_llama_dir, **kw) as eng:
        out, cached = _run(eng, prompt)
        assert _same(out, reference[0])
        assert cached == (36 if policy == "write_through" else 0)
        _assert_no_leak(eng)


TP2 = {"tp_size": 2, "num_threads": 1}


def test_tensor_parallel_tier_matches_recomputation(
    tiny_llama_dir: Path, tmp_path: Path, reference: list[Out]
) -> None:
    """TP=2: each rank stores and loads its own shard of every page (rank 0 decides)."""
    store = tmp_path / "tier"
    with _engine(tiny_llama_dir, hicache_storage_dir=str(store), **TP2) as eng:
        prompts = _prompts()
        for p, ref in zip(prompts, reference, strict=True):
            assert _same(_run(eng, p)[0], ref)
        assert eng.stats().hicache_stored_pages > 0
        out, cached = _run(eng, prompts[0])  # from the tier, on both ranks
        assert _same(out, reference[0]) and cached >= 32
        assert eng.stats().hicache_loaded_pages > 0
        _assert_no_leak(eng)  # the flush clears every rank's shard
    assert not list(store.glob("*/rank*/*.kv"))


def test_tensor_parallel_warm_restart_and_a_missing_shard(
    tiny_llama_dir: Path, tmp_path: Path, reference: list[Out]
) -> None:
    store = tmp_path / "tier"
    prompt = _prompts()[0]
    kw = {"hicache_storage_dir": str(store), **TP2}
    with _engine(tiny_llama_dir, **kw) as eng:
        assert _same(_run(eng, prompt)[0], reference[0])
    rank0, rank1 = (sorted(store.glob(f"*/rank{r}/*.kv")) for r in (0, 1))
    assert len(rank0) >= 9 and [p.name for p in rank0] == [p.name for p in rank1]
    assert rank0[0].read_bytes() != rank1[0].read_bytes()  # each rank's own KV heads
    with _engine(tiny_llama_dir, **kw) as eng:  # a restart finds every rank's shards
        out, cached = _run(eng, prompt)
        assert _same(out, reference[0]) and cached >= 36
    for path in sorted(store.glob("*/rank1/*.kv")):  # rank 1's shards lost: nothing served
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    with _engine(tiny_llama_dir, **kw) as eng:
        out, cached = _run(eng, prompt)
        assert _same(out, reference[0]) and cached == 0
        _assert_no_leak(eng)


def test_the_gpu_upload_path_stages_payloads_in_chunks(monkeypatch):
    """`KVPageIO._upload` (a GPU pool's load: pinned staging filled chunk by chunk, each chunk
    uploaded while the next fills, the staging reused after the last upload's event) gives the
    payloads' values, over several chunks and a second, shorter load; run here on CPU tensors
    with the CUDA event stubbed."""
    from radixlm.kernels.forward_batch import KVCache
    from radixlm.runtime import hicache_io

    kv = KVCache.allocate(3, 40, 16, 2, 64, torch.bfloat16, "cpu")
    for b in (*kv.k_buffers, *kv.v_buffers):
        b.copy_(torch.randn(b.shape))
    io = hicache_io.KVPageIO(kv)
    payloads = [bytes(p) for p in io.read_pages(list(range(10)))]
    monkeypatch.setattr(hicache_io, "UPLOAD_CHUNK_BYTES", 3 * io.page_bytes)
    waits = []

    class Event:
        def record(self) -> None:
            waits.append("record")

        def synchronize(self) -> None:
            waits.append("sync")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    want = torch.stack([
        torch.frombuffer(bytearray(p), dtype=torch.bfloat16).view(io.page_shape) for p in payloads
    ])  # fmt: skip
    assert torch.equal(io._upload(payloads), want)
    assert torch.equal(io._upload(payloads[:4]), want[:4])
    assert waits == ["record", "sync", "record"]  # the second load waited for the first
