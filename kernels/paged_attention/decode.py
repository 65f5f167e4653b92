"""Split-KV decode: each (sequence, KV head, split) program attends all query rows of the GQA
group to one chunk of the context; a reduce kernel merges the splits by their log-sum-exp (with
one split, at batches whose sequences and KV heads fill the GPU, a copy that casts every head of
a query row in one program).

The same two kernels serve target-verify (NUM_Q query tokens per sequence, causal among them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import next_pow2, num_sms
from .common import (
    LOG2E,
    OUT_BITS_SCALE,
    attend_range,
    check_inputs,
    kernel_caches,
    kv_mode_id,
    on_cpu,
    prepare_q,
)

MAX_SPLITS = 128
# fp8 K/V in the dots: common.KV_MODES, by default "bits" (common.kv_mode_id); a tuning file
# picks another (the H200's: "f16pairs", the cache read as 16-bit words, common.attend_tile_pairs)
MIN_SPLIT_TOKENS = 256  # below this a split costs more in launch and merge than it saves


# num_splits is not specialized (Triton would compile separate variants for 1 and for multiples
# of 16): a launcher outside CUDA graphs (the DSpark draft) must not compile while serving
@triton.jit(do_not_specialize=["num_splits"])
def decode_fwd_kernel(
    Q,
    K,
    V,
    KS,
    VS,
    PT,
    SL,
    OP,
    LSE,
    qk_scale,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_vt,
    stride_st,
    stride_pt,
    stride_opt,
    stride_oph,
    stride_ops,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    NUM_Q: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    KV_MODE: tl.constexpr,
    DOT_F32: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SL + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    # keys below seq_len - NUM_Q + 1 (causal; else seq_len) are visible to every query row:
    # no mask needed there
    seen_by_all = seq_len - NUM_Q + 1 if CAUSAL else seq_len
    full_end = start + tl.maximum(tl.minimum(end, seen_by_all) - start, 0) // BLOCK_N * BLOCK_N

    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < NUM_Q * GROUP
    qrow = b * NUM_Q + tok
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + qrow[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    # on CPU (DOT_F32) dot operands are fp32: Triton's interpreter multiplies bf16 as raw bits
    q, qk_scale = prepare_q(q, qk_scale, FP8, KV_MODE, DOT_F32)
    row_limit = seq_len - NUM_Q + tok if CAUSAL else seq_len - 1 + tok * 0

    pt_row = PT + b * stride_pt
    ks_base = KS + kvh
    vs_base = VS + kvh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, K, V, ks_base, vs_base, pt_row, kvh, start, full_end, end, row_limit,
        qk_scale, stride_kt, stride_vt, stride_st, PAGE, BLOCK_N, HEAD_DIM, FP8, KV_MODE, DOT_F32,
    )  # fmt: skip

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if FP8 and (KV_MODE == 3 or KV_MODE == 4):
        o = o * OUT_BITS_SCALE
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    w_ok = row_ok & (start < end)
    tl.store(
        OP
        + qrow[:, None] * stride_opt
        + head[:, None] * stride_oph
        + split * stride_ops
        + offs_d[None, :],
        o,
        mask=w_ok[:, None],
    )
    tl.store(LSE + qrow * stride_lt + head * stride_lh + split, lse, mask=w_ok)


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(
    OP,
    LSE,
    SL,
    Out,
    num_splits,
    stride_opt,
    stride_oph,
    stride_ops,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    NUM_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SL + t // NUM_Q)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    active = tl.cdiv(seq_len, chunk)  # splits that the first kernel wrote for this sequence
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < active
    lse = tl.load(LSE + t * stride_lt + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_ok, tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    o = tl.load(
        OP + t * stride_opt + h * stride_oph + offs_s[:, None] * stride_ops + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


@triton.jit
def decode_unsplit_out_kernel(
    OP,
    SL,
    Out,
    q_heads,
    stride_opt,
    stride_oph,
    stride_ot,
    stride_oh,
    NUM_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The merge of a single split: each program casts every head of one query row (zeros for a
    sequence of no keys, whose partial the attention kernel left unwritten). One program per row
    and head, as `decode_reduce_kernel` runs, costs more than moving the bytes at large batches."""
    t = tl.program_id(0)
    seq_len = tl.load(SL + t // NUM_Q)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_ok = (offs_h < q_heads)[:, None]
    o = tl.load(
        OP + t * stride_opt + offs_h[:, None] * stride_oph + offs_d[None, :],
        mask=h_ok & (seq_len > 0),
        other=0.0,
    )
    o_ptr = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=h_ok)


def decode_num_splits(
    batch: int, kv_heads: int, max_context: int, sms: int = 132, waves: float = 2.0
) -> int:
    """Splits per sequence so that batch * kv_heads * splits programs fill `waves` × `sms`.

    Fixed for a captured CUDA graph (the kernels adapt each sequence's chunk to its length)."""
    want = triton.cdiv(int(waves * sms), max(batch * kv_heads, 1))
    cap = max(1, triton.cdiv(max_context, MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, MAX_SPLITS))


def decode_workspace(
    max_tokens: int, q_heads: int, head_dim: int, max_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Preallocated split partials for decode/verify (static buffers for CUDA graphs).

    Returns (o_partial [max_tokens, q_heads, max_splits, head_dim] fp32,
             lse [max_tokens, q_heads, max_splits] fp32); max_tokens = batch * query tokens.
    """
    o = torch.empty(max_tokens, q_heads, max_splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(max_tokens, q_heads, max_splits, dtype=torch.float32, device=device)
    return o, lse


def _config(head_dim: int, rows: int, fp8: bool, cpu: bool) -> dict:
    if cpu:  # interpreter: small tiles so small test shapes still take several steps
        return dict(block_n=16, num_warps=4, num_stages=1)
    if head_dim == 256 or rows > 32:
        return dict(block_n=32, num_warps=4, num_stages=2)
    # best on H200 at head_dim 128, GQA 8 (benchmarks/results/paged_attention.log)
    return (
        dict(block_n=128, num_warps=4, num_stages=3)
        if fp8
        else dict(block_n=64, num_warps=4, num_stages=4)
    )


def split_kv_attention(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    page_size,
    sm_scale,
    num_q,
    out=None,
    k_scale=None,
    v_scale=None,
    num_splits=None,
    workspace=None,
    max_context=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
    kv_mode=None,
    maxnreg=None,
    causal=True,
):
    """Shared launcher of decode (num_q = 1) and verify (num_q = draft tokens per sequence;
    causal among them, or with ``causal=False`` each of them sees every key of its sequence)."""
    fp8 = check_inputs(q, k_cache, v_cache, page_table, seq_lens, page_size, k_scale, v_scale)
    batch = seq_lens.shape[0]
    tokens, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    assert tokens == batch * num_q, f"q has {tokens} rows, expected batch {batch} × {num_q}"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out: like q"
    if num_splits is None:
        if workspace is not None:
            num_splits = workspace[1].shape[2]
        else:
            ctx = max_context if max_context is not None else page_table.shape[1] * page_size
            num_splits = decode_num_splits(batch, kv_heads, ctx, num_sms(q.device))
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} not in 1..{MAX_SPLITS}"
    if workspace is None:
        workspace = decode_workspace(tokens, q_heads, head_dim, num_splits, q.device)
    o_part, lse = workspace
    assert o_part.dtype == torch.float32 and lse.dtype == torch.float32, "workspace: fp32"
    assert o_part.shape[0] >= tokens and o_part.shape[1] == q_heads and o_part.shape[3] == head_dim
    assert o_part.shape[2] >= num_splits and lse.shape[2] >= num_splits and lse.stride(2) == 1
    assert o_part.stride(3) == 1, "workspace o_partial: head_dim contiguous"
    if batch == 0:
        return out

    rows = next_pow2(max(16, num_q * group))
    if rows > 128:
        raise ValueError(
            f"split-KV attention holds num_q × GQA group = {num_q * group} query rows "
            "in one tile (at most 128); use extend_fwd for more draft tokens"
        )
    cfg = _config(head_dim, rows, fp8, on_cpu(q))
    block_n = block_n or cfg["block_n"]
    kv_mode = kv_mode_id(kv_mode, q) if fp8 else 0
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unread placeholders
    k_in, v_in = kernel_caches(k_cache, v_cache, kv_mode)
    # a register cap per thread lets more programs share an SM (Triton's compile option)
    launch = {"maxnreg": maxnreg} if maxnreg else {}
    decode_fwd_kernel[(batch, kv_heads, num_splits)](
        q,
        k_in,
        v_in,
        ks,
        vs,
        page_table,
        seq_lens,
        o_part,
        lse,
        sm_scale * LOG2E,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_in.stride(0),
        v_in.stride(0),
        kv_heads,
        page_table.stride(0),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        NUM_Q=num_q,
        PAGE=page_size,
        BLOCK_M=rows,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        FP8=fp8,
        KV_MODE=kv_mode,
        DOT_F32=on_cpu(q),
        CAUSAL=causal,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
        **launch,
    )
    if num_splits == 1:
        decode_unsplit_out_kernel[(tokens,)](
            o_part,
            seq_lens,
            out,
            q_heads,
            o_part.stride(0),
            o_part.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_Q=num_q,
            BLOCK_H=next_pow2(q_heads),
            HEAD_DIM=head_dim,
            num_warps=4,
        )
        return out
    block_s = next_pow2(num_splits)
    decode_reduce_kernel[(tokens, q_heads)](
        o_part,
        lse,
        seq_lens,
        out,
        num_splits,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_Q=num_q,
        BLOCK_N=block_n,
        BLOCK_S=block_s,
        HEAD_DIM=head_dim,
        num_warps=8 if block_s * head_dim >= 8192 else 4,
    )
    return out


def decode_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_context: int | None = None,
    **tuning,
) -> torch.Tensor:
    """Decode attention: one new query token per sequence over its paged KV.

    q: [batch, q_heads, head_dim] bf16/fp16, head_dim contiguous.
    k_cache, v_cache: [num_slots, kv_heads, head_dim] contiguous, q's dtype or float8_e4m3fn;
      k_scale, v_scale: [num_slots, kv_heads] fp32 (fp8 only).
    page_table: [batch, max_pages] int32 page ids; seq_lens: [batch] int32 cached lengths,
      the query token included (its K/V already stored at position seq_len - 1).
    page_size: tokens per page (slot = page_id * page_size + offset); sm_scale: softmax scale.
    out: [batch, q_heads, head_dim] in q's dtype, written whole (allocated when None).
    num_splits: context splits per sequence, each sequence's chunk adapts to its length; by
      default `decode_num_splits` (from workspace's split dim when a workspace is given).
    workspace: `decode_workspace(batch, q_heads, head_dim, max_splits)` buffers, for graphs.
    max_context: bound on seq_lens used to pick num_splits (default page_table width × page).
    tuning: block_n, num_warps, num_stages, kv_mode (fp8: a `KV_MODES` name, default by q's
      dtype: `kv_mode_id`), maxnreg (registers per thread, GPU only) overrides.
    Returns out.
    """
    return split_kv_attention(
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        page_size,
        sm_scale,
        1,
        out,
        k_scale,
        v_scale,
        num_splits,
        workspace,
        max_context,
        **tuning,
    )
