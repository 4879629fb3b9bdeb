"""Triton extend attention: a chunk of new tokens on top of a paged, cached prefix.

Grid `(request, q_block, q_head)`. A program holds `BLOCK_M` of its request's new tokens for one
query head and runs a flash-attention online softmax (fp32) over two loops:

1. the cached prefix (positions `0 .. prefix_len - 1`), read through the pages
   (`kv_indptr`/`kv_indices`), no mask besides the length;
2. the new tokens themselves (positions `prefix_len ..`), causal, stopping at the q block's end.

With a sliding window `WINDOW` > 0, both loops start at the block of the q block's first
window key and every tile is masked to keys `> position - WINDOW`.

NOTE: the new tokens' K/V are read from the `k`/`v` tensors of this forward (rows
`qo_indptr[r] ..`), not from the cache: the kernel does not depend on the store having run, and
it sees the values at the model's dtype. With a cache of the model's dtype (the runtime's only
layout) this equals reading them back after the store, which is what the torch twin does.

Twin: the extend branch of `radixlm.kernels.reference.paged_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.attention import (
    FLOAT_DTYPES,
    check_device,
    check_index,
    check_rows,
    interpret_mode,
    next_pow2,
)
from radixlm.kernels.decode_attention import LOG2E


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one masked `[BLOCK_M, BLOCK_N]` score tile (log2 domain) into the running state."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(
    K,
    V,
    rows,  # [BLOCK_N] int64 row (slot) of each key
    stride_k,
    stride_v,
    k_off,  # kv_head * stride of the head dim
    v_off,
    offs_d,  # [BLOCK_D]
    mask_n,  # [BLOCK_N] valid keys (ignored unless MASK_N)
    HEAD_DIM: tl.constexpr,
    MASK_N: tl.constexpr,  # False: every key of the tile is valid (no predicated loads)
    EVEN_D: tl.constexpr,  # BLOCK_D == HEAD_DIM
    UPCAST: tl.constexpr,
):
    """K and V tiles `[BLOCK_N, BLOCK_D]`; masked lanes (and padded head dims) read 0."""
    k_ptrs = K + rows[:, None] * stride_k + k_off + offs_d[None, :]
    v_ptrs = V + rows[:, None] * stride_v + v_off + offs_d[None, :]
    if MASK_N:
        mask = mask_n[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=mask, other=0.0)
        v = tl.load(v_ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _extend_kernel(
    Q,  # [T, Hq, D]
    K_new,  # [T, Hkv, D] keys of this forward's tokens
    V_new,  # [T, Hkv, D]
    Out,  # [T, Hq, D]
    K_buf,  # [S, Hkv, D] paged cache (prefix)
    V_buf,  # [S, Hkv, D]
    Req_ids,  # [N] requests handled by this launch
    Qo_indptr,  # [B + 1] rows of request r: Qo_indptr[r] .. Qo_indptr[r + 1] - 1
    Prefix_lens,  # [B] cached tokens before this forward
    Kv_indptr,  # [B + 1] offset of request r's page ids in Kv_indices
    Kv_indices,  # page ids
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # a multiple of BLOCK_N
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,  # BLOCK_D == HEAD_DIM: no head-dim masks on K/V loads
    UPCAST: tl.constexpr,  # cast tiles to fp32 before tl.dot (interpreter: bf16 dot is wrong)
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window (0: full attention)
):
    n = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    kv_head = head // GROUP
    req = tl.load(Req_ids + n)
    q_start = tl.load(Qo_indptr + req)
    ext_len = tl.load(Qo_indptr + req + 1) - q_start
    if m_start < ext_len:
        prefix_len = tl.load(Prefix_lens + req)
        page_base = tl.load(Kv_indptr + req)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)  # [BLOCK_M]
        q = tl.load(
            Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kb_off = kv_head * stride_kbh
        vb_off = kv_head * stride_vbh
        q_pos = prefix_len + offs_m  # [BLOCK_M]
        if WINDOW > 0:  # the first key any row of this q block sees, rounded to a block
            first = tl.maximum(prefix_len + m_start - WINDOW + 1, 0)
            first = (first // BLOCK_N) * BLOCK_N
        else:
            first = prefix_len * 0

        # 1. The cached prefix, through the pages: every new token sees all of it (within its
        # window). Whole blocks first (no masks), then the partial last block.
        prefix_full = (prefix_len // BLOCK_N) * BLOCK_N
        for start in range(tl.minimum(first, prefix_full), prefix_full, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            page = tl.load(Kv_indices + page_base + offs_n // PAGE_SIZE)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
            k, v = _load_kv_tile(
                K_buf, V_buf, slot, stride_kbs, stride_vbs, kb_off, vb_off, offs_d, offs_n,
                HEAD_DIM, False, EVEN_D, UPCAST,
            )  # fmt: skip
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
            if WINDOW > 0:
                qk = tl.where(offs_n[None, :] > q_pos[:, None] - WINDOW, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, PRECISION)
        for start in range(prefix_full, prefix_len, BLOCK_N):  # at most one block
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            page = tl.load(Kv_indices + page_base + offs_n // PAGE_SIZE, mask=mask_n, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
            k, v = _load_kv_tile(
                K_buf, V_buf, slot, stride_kbs, stride_vbs, kb_off, vb_off, offs_d, mask_n,
                HEAD_DIM, True, EVEN_D, UPCAST,
            )  # fmt: skip
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            if WINDOW > 0:
                qk = tl.where(offs_n[None, :] > q_pos[:, None] - WINDOW, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, PRECISION)

        # 2. The new tokens, causal. Blocks wholly before this q block are visible to every
        # row (no masks but the window); the diagonal blocks end at the q block's last row.
        kh_off = kv_head * stride_kh
        vh_off = kv_head * stride_vh
        new_first = tl.maximum(first - prefix_len, 0)
        new_first = (new_first // BLOCK_N) * BLOCK_N
        for start in range(tl.minimum(new_first, m_start), m_start, BLOCK_N):
            kv_rows = (q_start + start + tl.arange(0, BLOCK_N)).to(tl.int64)
            k, v = _load_kv_tile(
                K_new, V_new, kv_rows, stride_kt, stride_vt, kh_off, vh_off, offs_d, kv_rows,
                HEAD_DIM, False, EVEN_D, UPCAST,
            )  # fmt: skip
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
            if WINDOW > 0:
                k_pos = start + tl.arange(0, BLOCK_N)
                qk = tl.where(k_pos[None, :] > offs_m[:, None] - WINDOW, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, PRECISION)
        end = tl.minimum(ext_len, m_start + BLOCK_M)
        for start in range(m_start, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            kv_rows = (q_start + offs_n).to(tl.int64)
            k, v = _load_kv_tile(
                K_new, V_new, kv_rows, stride_kt, stride_vt, kh_off, vh_off, offs_d, mask_n,
                HEAD_DIM, True, EVEN_D, UPCAST,
            )  # fmt: skip
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
            causal = mask_n[None, :] & (offs_m[:, None] >= offs_n[None, :])
            if WINDOW > 0:
                causal = causal & (offs_n[None, :] > offs_m[:, None] - WINDOW)
            qk = tl.where(causal, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, PRECISION)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_blocks(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): tiny blocks in the interpreter (each
    program-iteration costs ~ms); 64x32 with 8 warps above head dim 128; else 128x64, 8 warps,
    3 stages (the fastest of 7 configs timed on an H100 at head dim 128, see README "GPU"):
    `benchmarks/kernels/bench_extend_attention.py --configs` times alternatives."""
    if interpret_mode():
        return 16, 16, 1, 1
    if head_dim > 128:
        return 64, 32, 8, 1
    return 128, 64, 8, 3


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D] this forward's keys
    v: torch.Tensor,  # [T, Hkv, D]
    o: torch.Tensor,  # [T, Hq, D] written at the rows of the selected requests
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    req_ids: torch.Tensor,  # [N] requests to attend
    qo_indptr: torch.Tensor,  # [B + 1] int
    prefix_lens: torch.Tensor,  # [B] int
    kv_indptr: torch.Tensor,  # [B + 1] offset of request r's page ids in kv_indices
    kv_indices: torch.Tensor,  # page ids
    page_size: int,
    scale: float,
    max_extend_len: int,
    window: int = 0,
) -> torch.Tensor:
    """Extend (prefill-chunk) attention over a paged prefix; returns `o`. `window` > 0: a
    query at position p sees keys p - window < j <= p.

    Invariants (not checked on device): request `r`'s new tokens are rows
    `qo_indptr[r] .. qo_indptr[r + 1] - 1` at positions `prefix_lens[r] ..`; its pages cover at
    least its prefix; `max_extend_len >= max(extend lengths of req_ids)` (host value, sizes the
    grid); `Hq % Hkv == 0`.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("k_buf", k_buf), ("v_buf", v_buf)):
        check_rows(name, t, 3, FLOAT_DTYPES)
    num_req = prefix_lens.shape[0]
    check_index("req_ids", req_ids)
    check_index("qo_indptr", qo_indptr, num_req + 1)
    check_index("prefix_lens", prefix_lens, num_req)
    check_index("kv_indptr", kv_indptr, num_req + 1)
    check_index("kv_indices", kv_indices)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if (
        o.shape != q.shape
        or k.shape != (t, hkv, d)
        or v.shape != k.shape
        or k_buf.shape[1:] != (hkv, d)
        or v_buf.shape != k_buf.shape
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"o {tuple(o.shape)}, k_buf {tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)}"
        )
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if k_buf.shape[0] % page_size:
        raise ValueError(f"cache of {k_buf.shape[0]} slots is not a whole number of pages")
    check_device(q, k, v, o, k_buf, v_buf, req_ids, qo_indptr, prefix_lens, kv_indptr, kv_indices)
    n = req_ids.shape[0]
    if n == 0 or max_extend_len <= 0:
        return o
    block_m, block_n, num_warps, num_stages = extend_blocks(d)
    if block_m % block_n:
        raise ValueError(f"BLOCK_M {block_m} is not a multiple of BLOCK_N {block_n}")
    interp = interpret_mode()
    grid = (n, triton.cdiv(max_extend_len, block_m), hq)
    _extend_kernel[grid](
        q,
        k,
        v,
        o,
        k_buf,
        v_buf,
        req_ids,
        qo_indptr,
        prefix_lens,
        kv_indptr,
        kv_indices,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        GROUP=hq // hkv,
        PAGE_SIZE=page_size,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(d)),
        EVEN_D=max(16, next_pow2(d)) == d,
        UPCAST=interp or q.dtype == torch.float32,
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        WINDOW=window,
        **({} if interp else {"num_warps": num_warps, "num_stages": num_stages}),
    )
    return o
