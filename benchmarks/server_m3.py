"""MiniMax-M3 rows of the server benchmark (`bench_server.py --m3`): sgl_atom's M3 class at a
real attention and MoE shape with dummy weights, its sparse layers against the same model served
all dense (``sparse_attention_freq`` all 0), one server each, one after the other.

Shape: SGLang 0.5.23 reads M3 checkpoints under ``model_type`` ``minimax_m2`` and ships no
config class with their dimensions, so the layer is MiniMax-M2's published one: hidden 3072,
48 query / 8 KV heads of dim 128 (rotary 64), 256 routed experts of width 1536 with 8 per token
(SGLang's fused Triton MoE), vocab 200064. Sparse attention as the kernels serve it: 128-token
blocks, top 16 blocks (init 1, local 1), index dim 128, one index head per KV head, selection
reused on every second sparse layer (``index_topk_freq`` 2). ``--m3-layers`` layers (default
6: 256 experts take 7.25 GB a layer, and 16 x 128K tokens of KV 8.6 GB a layer, on one H200).

Per server and batch, a 1K-token workload runs beside the long ones: the step time that grows
with the context, ``1 - step(1K) / step(C)`` (step = batch / decode tokens/s), is the attention
share of the step (the MoE, the projections and the LM head do not depend on the context). The
attention speedup of sparse over dense is the ratio of those context-dependent parts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

DEFAULT_WORKLOADS = "1x32768,1x65536,1x131072,16x32768,16x65536,16x131072"
BASE_PROMPT = 1024  # the short workload each batch is compared with
DEFAULT_LAYERS = 6
ENV = {"SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models"}
# the M3 targets at 128K, batch 16
TARGET_TOK_S, TARGET_ATTN = 4.0, 10.0

# sgl_atom.testing.tiny.m3_config's fields at MiniMax-M2's layer shape
M3_SHAPE = dict(
    hidden=3072,
    heads=48,
    kv_heads=8,
    head_dim=128,
    rotary_dim=64,
    max_pos=196608,
    experts=256,
    top_k=8,
    intermediate=1536,
    dense_intermediate=8192,  # only for layers without MoE (none here)
    shared_experts=0,
    routed_scaling=1.0,
    topk_blocks=16,
    index_dim=128,
    index_topk_freq=2,
    vocab=200064,
)
# --cpu-smoke --m3: the tiny m3 kind's shape (tests' "m3"), served on CPU
TINY_SHAPE = dict(
    M3_SHAPE,
    hidden=128,
    heads=4,
    kv_heads=2,
    max_pos=4096,
    experts=4,
    top_k=2,
    intermediate=64,
    dense_intermediate=256,
    topk_blocks=2,
    vocab=512,
)


def write_m3(root: Path, layers: int, dense: bool, tiny: bool = False) -> Path:
    """A config-only M3 checkpoint (weights from --load-format dummy): every layer MoE and
    sparse, or every layer dense."""
    from sgl_atom.testing.tiny import m3_config

    shape = TINY_SHAPE if tiny else M3_SHAPE
    spec = dict(shape, layers=layers, moe_freq=[1] * layers)
    spec["sparse_freq"] = [0 if dense else 1] * layers
    cfg = m3_config(shape["vocab"], spec)
    path = root / f"m3-{'dense' if dense else 'sparse'}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    return path


def with_base(workloads: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``workloads`` plus the 1K workload of each batch, short ones first."""
    extra = {(b, BASE_PROMPT) for b, _ in workloads}
    return sorted(set(workloads) | extra, key=lambda w: (w[0], w[1]))


def weights(r: dict) -> str:
    """The row's expert and projection weights: bf16, or fp8 (``--quantization fp8``)."""
    return r.get("weights") or "bf16"


def index(r: dict) -> str:
    """The sparse row's index-key dtype as named (``--m3-index``), "auto" where not; "-" for
    the dense model, which has no index."""
    return "-" if r.get("sparse") == "dense" else r.get("index") or "auto"


def _key(r: dict) -> tuple:
    return r["run"], weights(r), index(r), r["sparse"], r["batch"], r["prompt"]


def is_base_of(base: dict, row: dict) -> bool:
    """Whether ``base`` is the 1K row that ``row``'s attention part is measured against: the
    same run, weights, index and model kind at the same batch."""
    return (
        base.get("sparse") is not None
        and base["prompt"] == BASE_PROMPT
        and row["prompt"] != BASE_PROMPT
        and _key(base)[:5] == _key(row)[:5]
    )


def derive(rows: list[dict]) -> dict[tuple, dict]:
    """Per M3 row (run, weights, sparse, batch, prompt): the context-dependent part of the step
    (``attn_ms``) and its share, and for a sparse row its tokens/s and attention part against
    the dense row of the same run, weights and workload."""
    m3 = {_key(r): r for r in rows if r.get("sparse")}
    out: dict[tuple, dict] = {key: {} for key in m3}
    for (run, w, ix, kind, batch, prompt), r in m3.items():
        base = m3.get((run, w, ix, kind, batch, BASE_PROMPT))
        if prompt == BASE_PROMPT or not base or not (r["decode_tok_s"] and base["decode_tok_s"]):
            continue
        step, step0 = batch / r["decode_tok_s"], batch / base["decode_tok_s"]
        # a step no longer than the 1K step's: the context's part is below the run-to-run noise
        # (batch 1, where the weights dominate), not a negative time
        out[(run, w, ix, kind, batch, prompt)] = (
            {"attn_ms": (step - step0) * 1e3, "attn_share": 1 - step0 / step}
            if step > step0
            else {"attn_noise": True}
        )
    for (run, w, ix, kind, batch, prompt), d in out.items():
        dense = m3.get((run, w, "-", "dense", batch, prompt))
        if kind != "sparse" or not dense or not dense["decode_tok_s"]:
            continue
        d["vs_dense"] = (
            m3[(run, w, ix, kind, batch, prompt)]["decode_tok_s"] / dense["decode_tok_s"]
        )
        dense_attn = out[(run, w, "-", "dense", batch, prompt)].get("attn_ms", 0.0)
        if d.get("attn_ms", 0.0) > 0 and dense_attn > 0:
            d["attn_vs_dense"] = dense_attn / d["attn_ms"]
    return out


def m3_table(rows: list[dict]) -> str:
    """The M3 rows, sparse beside dense of the same run and workload."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import format_table

    extra = derive(rows)
    mine = sorted(
        (r for r in rows if r.get("sparse")),
        key=lambda r: (
            r["model"],
            weights(r),
            r["batch"],
            r["prompt"],
            r["run"],
            r["sparse"] == "sparse",
            index(r),
        ),
    )
    out = []
    for r in mine:
        d = extra.get(_key(r), {})
        out.append(
            [
                r["model"],
                weights(r),
                f"{r['batch']}x{r['prompt']}",
                f"{r['sparse']} {r['kv']}" + (f", {r['index']} index" if r.get("index") else ""),
                round(r["decode_tok_s"], 1),
                f"{d['vs_dense']:.2f}" if "vs_dense" in d else "-",
                f"{d['attn_ms']:.2f}"
                if "attn_ms" in d
                else ("< noise" if d.get("attn_noise") else "-"),
                f"{d['attn_share']:.0%}" if "attn_share" in d else "-",
                f"{d['attn_vs_dense']:.1f}" if "attn_vs_dense" in d else "-",
                r["ttft_s"],
                r["run"],
            ]
        )
    return format_table(
        [
            "model",
            "weights",
            "batch x prompt",
            "attention KV",
            "decode tok/s",
            f"vs dense (target >= {TARGET_TOK_S} at 16x128K)",
            "attention ms/step",
            "attention share",
            f"attention vs dense (target >= {TARGET_ATTN})",
            "TTFT s",
            "run",
        ],
        out,
    )


def plot(rows: list[dict], path: Path) -> None:
    """Decode tokens/s of the sparse and the dense model per workload (newest run of each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = {}
    for r in rows:
        if r.get("sparse") and r["prompt"] != BASE_PROMPT:
            kind = r["sparse"] + (f" ({r['index']} index)" if r.get("index") else "")
            latest[(kind, r["batch"], r["prompt"])] = r
    loads = sorted({(b, p) for _, b, p in latest})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    kinds = sorted({k for k, _, _ in latest})  # dense first, then the sparse servers
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        vals = [
            latest[(kind, b, p)]["decode_tok_s"] if (kind, b, p) in latest else 0 for b, p in loads
        ]
        ax.bar([x + width * (k - (len(kinds) - 1) / 2) for x in range(len(loads))], vals, width,
               label=kind)  # fmt: skip
    ax.set_xticks(range(len(loads)), [f"{b}x{p // 1024}K" for b, p in loads])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("MiniMax-M3 shape: sparse vs all-dense attention")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
