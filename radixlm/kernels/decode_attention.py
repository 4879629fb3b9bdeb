"""Triton paged decode attention: one query token per request, K/V read through pages.

Grid `(request, kv_head, kv_split)`. A program loads the `G = Hq // Hkv` query heads that share
its KV head as one `[BLOCK_H, D]` tile (GQA grouping: each K/V block is read once per KV head, not
once per query head) and walks its split of the sequence in `BLOCK_N`-token blocks with an online
softmax in fp32. With one split the program writes the normalized output directly; with several
(flash-decoding, for long contexts and small batches) it writes a partial output and its
log-sum-exp, and `_decode_reduce_kernel` (grid `(request, q_head)`) merges the splits.
With a sliding window `WINDOW` > 0 only the last `WINDOW` keys are read (and split).

Twin: the decode branch of `radixlm.kernels.reference.paged_attention`.
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

LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1_kernel(
    Q,  # [T, Hq, D]
    K_buf,  # [S, Hkv, D]
    V_buf,  # [S, Hkv, D]
    Out,  # [T, Hq, D] final output (single split)
    Mid_O,  # [N, Hq, NUM_SPLITS, BLOCK_D] fp32 partial outputs (split mode)
    Mid_LSE,  # [N, Hq, NUM_SPLITS] fp32 log2-sum-exp of each split (split mode)
    Req_ids,  # [N] request of each program row
    Q_rows,  # [B] row of Q (and O) holding request r's query
    Seq_lens,  # [B] kv length
    Kv_indptr,  # [B + 1] offset of request r's pages in Kv_indices
    Kv_indices,  # page ids
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_mn,
    stride_mh,
    stride_ms,
    stride_ln,
    stride_lh,
    GROUP: tl.constexpr,  # query heads per KV head
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,  # cast tiles to fp32 before tl.dot (interpreter: bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 (no tf32), else None
    WINDOW: tl.constexpr,  # sliding window (0: full attention)
):
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(Req_ids + n)
    q_row = tl.load(Q_rows + req).to(tl.int64)
    seq_len = tl.load(Seq_lens + req)
    page_base = tl.load(Kv_indptr + req)
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    else:
        lo = seq_len * 0
    split_len = tl.cdiv(seq_len - lo, num_splits)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g  # [BLOCK_H]
    mask_h = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        offs_n = block_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(Kv_indices + page_base + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # [BLOCK_N]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K_buf + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            V_buf + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))  # -inf for an empty split
        mid = Mid_O + n * stride_mn + heads[:, None] * stride_mh + split * stride_ms
        tl.store(mid + offs_d[None, :], out, mask=mask_h[:, None])
        tl.store(Mid_LSE + n * stride_ln + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    Out,  # [T, Hq, D]
    Mid_O,  # [N, Hq, NUM_SPLITS, BLOCK_D] fp32
    Mid_LSE,  # [N, Hq, NUM_SPLITS] fp32
    Req_ids,
    Q_rows,
    Seq_lens,
    num_splits,
    stride_ot,
    stride_oh,
    stride_mn,
    stride_mh,
    stride_ms,
    stride_ln,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Program (request, q_head): merge the non-empty splits by their log-sum-exp."""
    n = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(Req_ids + n)
    q_row = tl.load(Q_rows + req).to(tl.int64)
    seq_len = tl.load(Seq_lens + req)
    if WINDOW > 0:
        seq_len = tl.minimum(seq_len, WINDOW)  # the keys read: the last WINDOW
    split_len = tl.cdiv(seq_len, num_splits)
    offs_d = tl.arange(0, BLOCK_D)
    # NOTE: the running max / sum are kept as [BLOCK_D] vectors (all lanes equal) so every
    # loop-carried value has one type.
    m_i = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(0, num_splits):
        if split * split_len < seq_len:
            lse = tl.load(Mid_LSE + n * stride_ln + head * stride_lh + split)
            part = tl.load(Mid_O + n * stride_mn + head * stride_mh + split * stride_ms + offs_d)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp2(m_i - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + part * w
            l_i = l_i * alpha + w
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)
    tl.store(
        Out + q_row * stride_ot + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def decode_block_n(head_dim: int, page_size: int) -> int:
    """Tokens per K/V block: 16 in the interpreter (each block iteration costs ~ms), else 64
    (32 for head dims above 128 to bound registers)."""
    if interpret_mode():
        return 16
    return 32 if head_dim > 128 else 64


def decode_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    o: torch.Tensor,  # [T, Hq, D] written at the rows of the selected requests
    req_ids: torch.Tensor,  # [N] requests to attend (each has exactly one query row)
    q_rows: torch.Tensor,  # [B] row of q / o of request r's query token
    seq_lens: torch.Tensor,  # [B] kv length of request r (including its query token)
    kv_indptr: torch.Tensor,  # [B + 1] offset of request r's page ids in kv_indices
    kv_indices: torch.Tensor,  # page ids
    page_size: int,
    scale: float,
    num_kv_splits: int = 1,
    mid: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Paged decode attention; returns `o`. `window` > 0: only the last `window` keys.

    Invariants (not checked on device): the query of request `r` sits at position
    `seq_lens[r] - 1` and its own K/V is already stored; request `r`'s pages cover `seq_lens[r]`
    tokens; `Hq % Hkv == 0`. `mid` are optional preallocated split buffers
    (`decode_mid_buffers`) reused across layers; with `num_kv_splits > 1` they are required to
    be large enough or are allocated here.
    """
    check_rows("q", q, 3, FLOAT_DTYPES)
    check_rows("o", o, 3, FLOAT_DTYPES)
    check_rows("k_buf", k_buf, 3, FLOAT_DTYPES)
    check_rows("v_buf", v_buf, 3, FLOAT_DTYPES)
    num_req = seq_lens.shape[0]
    check_index("req_ids", req_ids)
    check_index("q_rows", q_rows, num_req)
    check_index("seq_lens", seq_lens, num_req)
    check_index("kv_indptr", kv_indptr, num_req + 1)
    check_index("kv_indices", kv_indices)
    _, hq, d = q.shape
    _, hkv, dk = k_buf.shape
    if o.shape != q.shape or v_buf.shape != k_buf.shape or dk != d:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, o {tuple(o.shape)}, k_buf "
            f"{tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)}"
        )
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if k_buf.shape[0] % page_size:
        raise ValueError(f"cache of {k_buf.shape[0]} slots is not a whole number of pages")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    check_device(q, k_buf, v_buf, o, req_ids, q_rows, seq_lens, kv_indptr, kv_indices)
    n = req_ids.shape[0]
    if n == 0:
        return o
    group = hq // hkv
    block_h = max(16, next_pow2(group))  # tl.dot needs >= 16 rows
    block_d = max(16, next_pow2(d))
    block_n = decode_block_n(d, page_size)
    single = num_kv_splits == 1
    if single:
        mid_o = mid_lse = o  # unused placeholders
    else:
        mid_o, mid_lse = mid if mid is not None else decode_mid_buffers(n, hq, d, num_kv_splits, q)
        if mid_o.shape[0] < n or mid_o.shape[2] < num_kv_splits or mid_o.shape[3] != block_d:
            raise ValueError(f"mid buffers {tuple(mid_o.shape)} too small for this call")
    upcast = interpret_mode() or q.dtype == torch.float32
    precision = "ieee" if q.dtype == torch.float32 else None
    interp = interpret_mode()
    _decode_stage1_kernel[(n, hkv, num_kv_splits)](
        q,
        k_buf,
        v_buf,
        o,
        mid_o,
        mid_lse,
        req_ids,
        q_rows,
        seq_lens,
        kv_indptr,
        kv_indices,
        scale * LOG2E,
        num_kv_splits,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        o.stride(0),
        o.stride(1),
        0 if single else mid_o.stride(0),
        0 if single else mid_o.stride(1),
        0 if single else mid_o.stride(2),
        0 if single else mid_lse.stride(0),
        0 if single else mid_lse.stride(1),
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=d,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SINGLE_SPLIT=single,
        UPCAST=upcast,
        PRECISION=precision,
        WINDOW=window,
        **({} if interp else {"num_warps": 4, "num_stages": 2}),
    )
    if not single:
        _decode_reduce_kernel[(n, hq)](
            o,
            mid_o,
            mid_lse,
            req_ids,
            q_rows,
            seq_lens,
            num_kv_splits,
            o.stride(0),
            o.stride(1),
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            HEAD_DIM=d,
            BLOCK_D=block_d,
            WINDOW=window,
        )
    return o


def decode_mid_buffers(
    num_req: int, num_q_heads: int, head_dim: int, num_kv_splits: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV scratch: partial outputs `[N, Hq, splits, BLOCK_D]` and LSEs `[N, Hq, splits]`
    (fp32), allocated once per forward and shared by every layer."""
    block_d = max(16, next_pow2(head_dim))
    mid_o = torch.empty(
        (num_req, num_q_heads, num_kv_splits, block_d), dtype=torch.float32, device=like.device
    )
    mid_lse = torch.empty(
        (num_req, num_q_heads, num_kv_splits), dtype=torch.float32, device=like.device
    )
    return mid_o, mid_lse
