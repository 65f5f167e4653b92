"""store_kv against its torch reference: exact bytes for copies and fp8, exact scales."""

import pytest
import torch
from helpers import device, poisoned, rel_err
from sgl_atom.kernels import kv_quant as kvq

DEV = device()
FP8 = torch.float8_e4m3fn


def _inputs(tokens, kv_heads, head_dim, slots, seed, strided):
    g = torch.Generator().manual_seed(seed)
    # k/v as slices of a fused qkv row, like the backend receives them
    width = (2 + 2 * strided) * kv_heads * head_dim
    qkv = torch.randn(tokens, width, generator=g).to(torch.bfloat16).to(DEV)
    k = qkv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, width - kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    loc = torch.randperm(slots, generator=g)[:tokens].to(DEV)
    return k, v, loc


def _caches(slots, kv_heads, head_dim, dtype):
    caches = [poisoned((slots, kv_heads, head_dim), dtype, DEV) for _ in range(2)]
    scales = (
        [poisoned((slots, kv_heads), torch.float32, DEV) for _ in range(2)]
        if dtype == FP8
        else [None, None]
    )
    return caches + scales


CASES = [(63, 1, 64, True), (1, 3, 128, False), (40, 8, 256, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "tokens,kv_heads,head_dim,strided",
    CASES,
    ids=[f"t{t}-h{h}-d{d}{'-strided' if s else ''}" for t, h, d, s in CASES],
)
def test_store_kv_matches_reference(tokens, kv_heads, head_dim, strided, dtype):
    slots = 2 * tokens + 5
    k, v, loc = _inputs(tokens, kv_heads, head_dim, slots, seed=tokens + head_dim, strided=strided)
    got = _caches(slots, kv_heads, head_dim, dtype)
    want = [t.clone() if t is not None else None for t in got]
    kvq.store_kv(k, v, *got[:2], loc, *got[2:])
    kvq.reference_store_kv(k, v, *want[:2], loc, *want[2:])
    for g, w in zip(got, want, strict=True):
        if g is None:
            continue
        # same bytes everywhere: written slots equal the reference, other slots keep their poison
        assert torch.equal(g.view(torch.uint8).cpu(), w.view(torch.uint8).cpu())
    assert not torch.isnan(got[0][loc].float()).any()


def test_store_kv_int32_loc_and_cache_cast():
    k, v, loc = _inputs(17, 2, 64, 40, seed=3, strided=False)
    kc, vc = (poisoned((40, 2, 64), torch.float32, DEV) for _ in range(2))
    kvq.store_kv(k, v, kc, vc, loc.int())
    assert torch.equal(kc[loc], k.float()) and torch.equal(vc[loc], v.float())


def test_store_kv_rejects_bad_inputs():
    k, v, loc = _inputs(4, 2, 64, 8, seed=0, strided=False)
    with pytest.raises(ValueError, match="int8"):
        kvq.store_kv(
            k, v, *(torch.zeros(8, 2, 64, dtype=torch.int8, device=DEV) for _ in range(2)), loc
        )
    with pytest.raises(AssertionError, match="k_scale"):
        kvq.store_kv(k, v, *(torch.zeros(8, 2, 64, dtype=FP8, device=DEV) for _ in range(2)), loc)


def _outlier_rows(tokens=64, kv_heads=2, head_dim=64, seed=0):
    """Rows whose magnitudes span 1e-3..1 with a few outlier channels 300× larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, kv_heads, head_dim, generator=g)
    x *= torch.logspace(-3, 0, tokens)[:, None, None]
    x[..., [5, 17]] *= 300
    return x.to(torch.bfloat16).to(DEV)


def test_fp8_per_token_scales_beat_per_tensor_scale():
    """Per-(token, head) scales keep outlier channels and small rows; one scale of 1.0 clips
    the outliers at 448 and flushes small rows to zero."""
    x = _outlier_rows()
    tokens, kv_heads, head_dim = x.shape
    loc = torch.arange(tokens, device=DEV)
    kc, vc = (torch.empty(tokens, kv_heads, head_dim, dtype=FP8, device=DEV) for _ in range(2))
    ks, vs = (torch.empty(tokens, kv_heads, device=DEV) for _ in range(2))
    kvq.store_kv(x, x, kc, vc, loc, ks, vs)
    per_token = kc.float() * ks[..., None]
    per_tensor = x.float().clamp(-448, 448).to(FP8).float()  # upstream: scale 1.0
    err_token, err_tensor = rel_err(per_token, x), rel_err(per_tensor, x)
    assert err_token < 0.05, err_token
    assert err_tensor > 5 * err_token, (err_token, err_tensor)
    # rows of small magnitude: per-token keeps their relative precision, per-tensor loses them
    small = (slice(0, tokens // 4), slice(None), slice(20, None))  # no outlier channel
    assert rel_err(per_token[small], x[small]) < 0.05
    assert rel_err(per_tensor[small], x[small]) > 0.2
