"""Where a packed 4-bit index's block scores differ from a float64 reference computed on the CPU,
in decode, extend and verify row tiles (the GPU kernel tests' cases), per dot path and row tile,
and which alternative reference they agree with (q's step from a token's max or each half's,
unrounded q, positions shifted by one).

    python3 benchmarks/probe_int4_rows.py       (benchmarks/results/probe_int4_rows.log)
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(ROOT, "tests", "unit", "kernels")
sys.path.insert(0, UNIT)
sys.path.insert(0, ROOT)
_spec = importlib.util.spec_from_file_location(
    "unit_sparse", os.path.join(UNIT, "test_sparse_attention.py")
)
_u = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _u  # dataclasses look their module up there
_spec.loader.exec_module(_u)
sa = _u.sa

MODES = {
    "extend": ([1500, 2100], [300, 77]),
    "verify": ([2900, 1031, 700], [4, 4, 4]),
    "decode": ([3000, 4097, 128, 1], [1, 1, 1, 1]),
}


def _on_step(q: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    exp = (torch.frexp(amax).exponent - 1).clamp(-120, 127)
    step = torch.pow(2.0, (exp - 6).double())  # on the CPU: exact
    return torch.floor(q / step + 0.5).clamp(max=127.0) * step


def rounded(q: torch.Tensor, per: str) -> torch.Tensor:
    """q [t, h, d] float64 as 8-bit integers times a power-of-two step whose max is per "row"
    (the kernels' rule), per "token", per "half" row, or the "first-half" alone; "none": q."""
    half = q.shape[-1] // 2
    if per == "none":
        return q
    if per == "row":  # the library's own reference rounding
        return sa.int4_query(q)
    if per == "half":
        return torch.cat([sa.int4_query(q[..., :half]), sa.int4_query(q[..., half:])], -1)
    if per == "first-half":
        return _on_step(q, q[..., :half].abs().amax(-1, keepdim=True))
    return _on_step(q, q.abs().amax((-1, -2), keepdim=True))  # per token


def scores64(c, qr: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """Block scores of q rows `qr` over c's 4-bit keys, positions shifted by `shift`."""
    keys = sa.unpack_int4(c.ik.cpu(), torch.float64) * c.iks.cpu().double()[:, None]
    nblk = -(-int(c.seq_lens.max()) // 128)
    out = torch.full((*qr.shape[:2], nblk), float("-inf"), dtype=torch.float64)
    for b, lo, hi, n, qpos in sa.reference._sequences(c.seq_lens.cpu(), c.indptr.cpu()):
        slots = sa.reference.slots_of(c.page_table[b].cpu(), n, c.page_size)
        s = torch.einsum("thd,pd->thp", qr[lo:hi], keys[slots]) * 0.09
        hidden = torch.arange(n)[None, None, :] > (qpos + shift)[:, None, None]
        pad = torch.full((*s.shape[:2], nblk * 128), float("-inf"), dtype=torch.float64)
        pad[..., :n] = s.masked_fill(hidden, float("-inf"))
        out[lo:hi] = pad.view(*s.shape[:2], nblk, 128).amax(-1)
    return out


def report(got: torch.Tensor, alts: dict, vis: torch.Tensor, pos: torch.Tensor) -> str:
    line = ""
    for name, ref in alts.items():
        err = ((got[vis] - ref[vis]).norm() / ref[vis].norm()).item()
        line += f" {name} {err:.1e}"
    ref = alts["row"]
    bad = vis & ((got - ref).abs() > 1e-6 * ref.abs().clamp(min=1e-3))
    line += f" | off {int(bad.sum())}/{int(vis.sum())}"
    if bad.any():
        t, h, k = bad.nonzero(as_tuple=True)
        last = (k == pos[t] // 128).float().mean().item()
        ratio = got[bad] / ref[bad]
        line += f" in last block {last:.2f}, ratio {ratio.min():.4f}..{ratio.max():.4f}"
    return line


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for mode, (seqs, qo) in MODES.items():
        for page in (128,) if mode == "decode" else (16, 64):
            c = _u.make_case(
                seqs, qo, page, kv_heads=8, group=8, head_dim=128, index_dim=128,
                dtype=torch.bfloat16, index_int4=True, decode=mode == "decode", seed=page, dev=dev,
            )  # fmt: skip
            q64 = c.iq.cpu().double()
            bounds = zip(
                c.seq_lens.tolist(), c.indptr[:-1].tolist(), c.indptr[1:].tolist(), strict=True
            )
            pos = torch.cat([n - (hi - lo) + torch.arange(hi - lo) for n, lo, hi in bounds])
            nblk = -(-int(c.seq_lens.max()) // 128)
            vis = torch.arange(nblk)[None, None, :] <= (pos // 128)[:, None, None]
            vis = vis.expand(q64.shape[0], 8, nblk)
            alts = {p: scores64(c, rounded(q64, p)) for p in ("row", "token", "half", "none")}
            alts["first-half"] = scores64(c, rounded(q64, "first-half"))
            alts["pos+1"] = scores64(c, rounded(q64, "row"), 1)
            for dots in ("f16", "i8"):
                sa.block_select.INT4_DOT = dots
                for block_m in (None,) if mode == "decode" else (None, 16):
                    got = sa.block_scores(
                        c.iq, c.ik, c.page_table, c.seq_lens, page, 0.09, c.qo_indptr,
                        c.max_qo_len, index_scale=c.iks, blocks_per_program=1, block_m=block_m,
                    )  # fmt: skip
                    got = got.cpu().double()[..., :nblk]
                    head = f"{mode:6s} page{page:<3d} {dots} block_m={block_m}:"
                    print(head + report(got, alts, vis, pos), flush=True)


if __name__ == "__main__":
    main()
