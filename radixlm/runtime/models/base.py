"""`DecoderLM`: the causal LM skeleton every family shares (embedding, a stack of decoder layers,
final norm, LM head) and checkpoint loading by Hugging Face names.

A family subclasses it and says only what differs: `make_layer` (its decoder layer), and
optionally `embed_scale`, `final_logit_softcap`, `rope_for` (per-layer RoPE tables),
`weight_renames` (checkpoint names to module names) and `FUSED` (checkpoint projections fused
at load time). Layers take `(x, residual, batch, rope, attn)` and return `(x, residual)`: the
residual stream is `residual + x` (the final norm adds them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kernels.layer_ops import LayerOps
from radixlm.kernels.reference import softcap_ref
from radixlm.runtime.models.layers import RMSNorm, RotaryEmbedding, head_dim_of
from radixlm.runtime.quantization.weights import QuantizedWeight

# Grammar masks for the LM head (``GrammarStep.fused_mask``): called with the logits' row count
# R right before the head, it returns (bitmask [>= R, ceil(V / 32)] int32 CPU, the rows to mask)
# once the head will put those masks into the logits (the caller then counts them applied), or
# None (no masks: the logits as usual).
LogitsMask = Callable[[int], "tuple[torch.Tensor, Sequence[int]] | None"]
# Without masks, an LM head that writes float32 itself (``takes_masks``) does so for up to this
# many rows: measured on the AVX512_BF16 EPYC (bf16 packed head, SmolLM2's 49k vocabulary, 2
# threads, caches flushed between calls), head + ``.float()`` -> float32 head: 1 row 950 -> 820
# us, 8 rows 1630-1860 -> 1520, 16 rows 2750 -> 2700, 24 rows 3930 -> 4060, 32 rows 5000 ->
# 5120 (twice the bytes stored while the weights stream); the int8 head (compute-bound) gains
# at every count measured (1 row 920 -> 830 us, 16 rows 5120 -> 4910, 32 rows 9440 -> 9290).
# With masks it always does (the mask pass it saves costs more).
FLOAT_HEAD_MAX_ROWS = 16

# checkpoint projection -> (fused module, shard index)
LLAMA_FUSED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLM(nn.Module):
    """Causal LM whose forward consumes a ragged `ForwardBatch` and returns selected logits."""

    FUSED: ClassVar[dict[str, tuple[str, int]]] = LLAMA_FUSED
    # Whether the compiled CPU layer stack (`cpu_stack.CpuDecoderStack`) can run this family.
    CPU_STACK: ClassVar[bool] = False

    def __init__(self, config: Any, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim_of(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.make_layer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = self.make_norm(config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.max_positions = max_positions or config.max_position_embeddings
        self.build_rope(config, self.max_positions)
        self.stack = None  # `CpuDecoderStack` (set by the runner): one compiled call; None: Python
        self.embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
        self.final_logit_softcap: float = 0.0

    # -- what a family defines ----------------------------------------------------------------

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        raise NotImplementedError

    def make_norm(self, dim: int) -> RMSNorm:
        return RMSNorm(dim, self.config.rms_norm_eps)

    def build_rope(self, config: Any, max_positions: int, device: torch.device | None = None):
        """(Re)build the RoPE tables (real fp32 tensors, also when the model is on meta)."""
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions)
        if device is not None:
            self.rotary.to(device)
            self.rotary.ops = self.layer_ops

    def rope_for(self, layer_id: int) -> RotaryEmbedding:
        return self.rotary

    def weight_renames(self, name: str) -> str:
        """A checkpoint name (without `model.`) as this model's parameter name."""
        return name

    # -- shared ---------------------------------------------------------------------------------

    def set_layer_ops(self, ops: LayerOps) -> None:
        """Run the norms, RoPE and SiLU-and-mul through `ops` (`radixlm.kernels.layer_ops`:
        the torch twins by default, fused C++ ops on CPU, Triton on CUDA)."""
        for module in self.modules():
            if hasattr(module, "ops") and isinstance(module.ops, LayerOps):
                module.ops = ops

    @property
    def layer_ops(self) -> LayerOps:
        return self.norm.ops

    def tie_weights(self) -> None:
        """Share lm_head with the embedding (again after `to_empty`, which unties)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def sliding_windows(self) -> list[int]:
        """Each layer's attention window (0: full attention)."""
        return [getattr(layer.self_attn, "window", 0) for layer in self.layers]

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, attn, logits_mask: LogitsMask | None = None
    ) -> torch.Tensor:  # [R, V] float32
        """The logits of ``batch.logits_indices``. An LM head that ``takes_masks`` (radixlm's
        bf16 packed and int8 CPU kernels) writes them as float32 itself (no conversion pass
        after it), with ``logits_mask``'s grammar masks in them (without masks, for up to
        ``FLOAT_HEAD_MAX_ROWS`` rows); ``logits_mask`` is not called for other heads."""
        x = self.embed_tokens(batch.input_ids)  # [T, H]
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if self.stack is not None and self.stack.takes(x.shape[0]):  # the same ops, one call
            x, residual = self.stack(x, batch)
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, batch, self.rope_for(i), attn)
        rows = batch.logits_indices
        x = self.norm(x[rows], residual[rows])  # [R, H]
        head = self.lm_head
        takes = None if self.final_logit_softcap else getattr(head, "takes_masks", None)
        if takes is not None and takes(x):
            # float32 straight from the kernel (no conversion pass), with any grammar masks
            masks = logits_mask(x.shape[0]) if logits_mask is not None else None
            if masks is not None:
                return head.masked_logits(x, *masks)
            if x.shape[0] <= FLOAT_HEAD_MAX_ROWS:
                return head.masked_logits(x)
        logits = head(x)
        if self.final_logit_softcap:
            logits = softcap_ref(logits, self.final_logit_softcap)
        return logits.float()

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> dict[str, list[QuantizedWeight]]:
        """Load Hugging Face names, fusing the `FUSED` projections (q/k/v, gate/up) and the
        modules' own loaders (`load_checkpoint_tensor`: MoE experts). Missing weights are an
        error. `QuantizedWeight`s (a GGUF's blocks) are returned, not loaded: module path -> its
        fused parts in order, for `radixlm.runtime.quantization.install_quantized`."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        staged: dict[str, dict[int, QuantizedWeight]] = {}  # module path -> fused parts
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.weight_renames(name.removeprefix("model."))
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            owner = self._custom_loader(modules, parts)
            if owner is not None:
                path, module = owner
                loaded.update(module.load_checkpoint_tensor(path, name, tensor))
                continue
            if len(parts) >= 2 and parts[-2] in self.FUSED:
                target, shard = self.FUSED[parts[-2]]
                pname = ".".join(parts[:-2] + [target, parts[-1]])
                if isinstance(tensor, QuantizedWeight):
                    staged.setdefault(pname.removesuffix(".weight"), {})[shard] = tensor
                else:
                    offset, size = self._shard_range(pname, shard)
                    params[pname].data[offset : offset + size].copy_(tensor)
                loaded.add(f"{pname}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
            if isinstance(tensor, QuantizedWeight):
                staged.setdefault(name.removesuffix(".weight"), {})[0] = tensor
            else:
                module = modules[name.rsplit(".", 1)[0]] if "." in name else self
                offset = getattr(module, "weight_offset", 0.0)
                params[name].data.copy_(tensor + offset if offset else tensor)
            loaded.add(name)
        missing = self._expected_weights(params, modules) - loaded
        if missing:
            raise KeyError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        return {path: [d[i] for i in sorted(d)] for path, d in staged.items()}

    @staticmethod
    def _custom_loader(modules: dict[str, nn.Module], parts: list[str]):
        """The nearest enclosing module with its own checkpoint loader, as (path, module)."""
        for i in range(len(parts) - 1, 0, -1):
            path = ".".join(parts[:i])
            module = modules.get(path)
            if module is not None and hasattr(module, "load_checkpoint_tensor"):
                return path, module
        return None

    def _expected_weights(self, params: dict[str, Any], modules: dict[str, nn.Module]) -> set[str]:
        fused_parts: dict[str, int] = {}
        for target, shard in self.FUSED.values():
            fused_parts[target] = max(fused_parts.get(target, 0), shard + 1)
        expected: set[str] = set()
        for pname in params:
            parts = pname.split(".")
            owner = self._custom_loader(modules, parts)
            if owner is not None:
                expected.update(owner[1].expected_checkpoint_tensors(owner[0]))
            elif len(parts) >= 2 and parts[-2] in fused_parts and fused_parts[parts[-2]] > 1:
                expected.update(f"{pname}#{i}" for i in range(fused_parts[parts[-2]]))
            elif not (pname == "lm_head.weight" and self.tie_word_embeddings):
                expected.add(pname)
        return expected

    def _shard_range(self, pname: str, shard: int) -> tuple[int, int]:
        """Rows of fused parameter `pname` that checkpoint part `shard` fills."""
        total = self.get_parameter(pname).shape[0]
        attn = self.layers[0].self_attn
        if pname.rsplit(".", 2)[-2] == "qkv_proj":
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:  # gate_up_proj: two equal halves
            sizes = [total // 2, total // 2]
        return sum(sizes[:shard]), sizes[shard]
