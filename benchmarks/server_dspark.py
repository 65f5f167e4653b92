"""DSpark rows of the server benchmark (`bench_server.py --spec`): a random draft of real shape
written at start, the server flags that serve it under forced acceptance, the spec decode log
lines, and the second md table.

The draft is 2 layers at the target's hidden size, heads and MLP width, taps from two target
layers, the target's vocab (Markov head of rank 256); about 1 GB at bf16 for the Llama-3-8B
shape, so it is generated into the run's temp dir rather than carried to the GPU machine. Block
sizes share one weights file (k does not change a tensor's shape), linked into each k's folder.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

DRAFT_LAYERS = 2
MARKOV_RANK = 256
# "k:N": block k (verify window k + 1) with N drafts committed per verify
DEFAULT_BLOCKS = "4:3,7:5"
DEFAULT_DRAFT_KV = "bf16,fp8"
DEFAULT_WORKLOADS = "1x4096,16x4096,64x4096"
# SGLang's "Decode batch" line (scheduler_components/metrics_reporter.py); a spec server adds
# "accept len: X" before the graph flag and "gen throughput (token/s)"
SPEC_RE = re.compile(
    r"Decode batch.*?#running-req: (\d+).*?(?:accept len: ([\d.]+).*?)?"
    r"gen throughput \(token/s\): ([\d.]+)"
)
# rows of the plain decode without overlap scheduling (`bench_server.py --serial-plain`)
SERIAL = "none-serial"
# a DSpark server under SGLang's overlap scheduling (its default), without it, or under it with
# each step's lengths copied to the host (SGL_ATOM_DSPARK_HOST_SEQ_LENS: the next step then
# waits for every verify, as before the lengths stayed on the device)
OVERLAP_FLAGS = {"on": [], "off": ["--disable-overlap-schedule"], "host-lens": []}
OVERLAP_ENV = {"host-lens": {"SGL_ATOM_DSPARK_HOST_SEQ_LENS": "1"}}
OVERLAP_NOTES = {"off": ", no overlap", "host-lens": ", host lengths"}
OVERLAP_SUFFIX = {"off": "-no-overlap", "host-lens": "-host-lens"}


def overlap_note(r: dict) -> str:
    """ ", no overlap" for a DSpark row measured without overlap scheduling, ", host lengths"
    for one whose steps' lengths were copied to the host."""
    return OVERLAP_NOTES.get(r.get("overlap"), "")


STEP_TARGET = 1.35  # one draft+verify step <= 1.35x a plain decode step


def parse_blocks(text: str) -> list[tuple[int, int]]:
    """``"4:3,7:5"`` -> [(4, 3), (7, 5)], each N in 0..k-1 (what the server accepts)."""
    out = []
    for item in text.split(","):
        k, _, n = item.partition(":")
        k, n = int(k), int(n)
        if not 0 <= n < k:
            raise SystemExit(f"--spec-blocks {item}: forced acceptance N must lie in 0..k-1")
        out.append((k, n))
    return out


def tap_layers(num_layers: int) -> list[int]:
    """Two taps, a third and two thirds down the target, both below its last layer (whose output
    SGLang's Llama does not capture)."""
    taps = [num_layers // 3, 2 * num_layers // 3]
    assert taps[0] < taps[1] < num_layers - 1, f"no two taps below layer {num_layers - 1}"
    return taps


def draft_config(shape: dict, block: int, max_pos: int):
    from sgl_atom.speculative.dspark.config import DSparkDraftConfig

    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    cfg = DSparkDraftConfig(
        architecture="AtomDSparkDraftModel",
        hidden_size=hidden,
        num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=hidden // heads,
        intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        block_size=block,
        target_layer_ids=tuple(tap_layers(shape["num_hidden_layers"])),
        num_target_layers=shape["num_hidden_layers"],
        mask_token_id=shape["vocab_size"] - 1,
        markov_rank=min(MARKOV_RANK, shape["vocab_size"]),
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=max_pos,
        target_hidden_size=hidden,
    )
    return DSparkDraftConfig.from_hf_dict(cfg.to_hf_dict())  # validates what is written


def write_drafts(model: str, shape: dict, blocks: list[int], root: Path, max_pos: int) -> dict:
    """One draft checkpoint folder per block size under ``root``: {k: path}. Random bf16
    weights (seeded), written once and linked into every folder."""
    import torch
    from safetensors.torch import save_file

    from sgl_atom.speculative.dspark.weights import init_draft_weights

    weights_file = root / f"dspark-{model}.safetensors"
    paths = {}
    for k in blocks:
        cfg = draft_config(shape, k, max_pos)
        if not weights_file.exists():
            w = init_draft_weights(cfg, seed=0, init_range=0.02, dtype=torch.bfloat16)
            save_file(w, str(weights_file), metadata={"format": "pt"})
            gb = sum(t.numel() * t.element_size() for t in w.values()) / 1e9
            print(f"[bench_server] {model} DSpark draft weights: {gb:.2f} GB", flush=True)
        path = root / f"dspark-{model}-k{k}"
        path.mkdir(parents=True, exist_ok=True)
        extra = dict(hidden_act="silu", attention_bias=False, torch_dtype="bfloat16")
        hf = cfg.to_hf_dict() | extra | dict(tie_word_embeddings=False)
        (path / "config.json").write_text(json.dumps(hf, indent=1, sort_keys=True))
        link = path / "model.safetensors"
        if not link.exists():
            link.symlink_to(weights_file)
        paths[k] = path
    return paths


def draft_variant(draft_kv: str) -> tuple[str, list[str]]:
    """A ``--draft-kv`` entry -> (the pool dtype, the draft's weight flags): ``KV`` or
    ``KV+w8``, the latter with the draft's GEMMs in fp8 (``--speculative-draft-model-quantization
    fp8``)."""
    kv, _, weights = draft_kv.partition("+")
    if weights not in ("", W8):
        raise ValueError(f"--draft-kv {draft_kv}: a pool dtype, optionally +{W8}")
    return kv, (["--speculative-draft-model-quantization", "fp8"] if weights else [])


W8 = "w8"  # a --draft-kv suffix: the ATOM_DSPARK draft's GEMMs in fp8


def spec_server_args(
    draft: Path, draft_kv: str, forced: int | None, overlap: str = "on"
) -> list[str]:
    """ATOM_DSPARK with ``draft``, its KV pool at ``draft_kv`` (bf16 / fp8, given to SGLang's
    own flag in its spelling: bf16 / fp8_e4m3; a ``+w8`` suffix: the draft's GEMMs in fp8),
    ``forced`` drafts committed per verify (None: the drafts the target accepts), under overlap
    scheduling or not (``OVERLAP_FLAGS``)."""
    from sgl_atom.speculative.draft_kv_dtype import to_sglang_dtype

    draft_kv, weights = draft_variant(draft_kv)
    args = [
        "--speculative-algorithm",
        "ATOM_DSPARK",
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-draft-kv-cache-dtype",
        to_sglang_dtype(draft_kv),
        *OVERLAP_FLAGS[overlap],
        *weights,
    ]
    return args if forced is None else [*args, "--atom-dspark-forced-accept", str(forced)]


SPEC_ENV = {"SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models"}

# --spec-sglang: SGLang's own DSpark worker (`--speculative-algorithm DSPARK`,
# srt/speculative/dspark_components) on the same target and the same draft weights, under its
# simulated acceptance. It reads the same config fields and weight names; only the architecture
# differs (one of the names SGLang's srt/models/dspark.py registers).
SGLANG_SPEC = "sglang-dspark"
SGLANG_DRAFT_ARCH = "DSparkDraftModel"


def sglang_draft(draft: Path) -> Path:
    """The draft folder ``draft`` as SGLang's DSpark loads it, beside it: the same config under
    SGLang's architecture name, the same weights file linked."""
    path = draft.with_name(f"{draft.name}-sglang")
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["architectures"] = [SGLANG_DRAFT_ARCH]
    (path / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    link = path / "model.safetensors"
    if not link.exists():
        link.symlink_to((draft / "model.safetensors").resolve())
    return path


def sglang_spec_server_args(
    draft: Path, block: int, draft_kv: str, draft_backend: str | None, overlap: str = "on"
) -> list[str]:
    """SGLang's DSPARK with ``draft`` (an :func:`sglang_draft` folder) at block ``block`` (its
    verify window k + 1, checked against the checkpoint's block_size at start-up), the draft's
    KV at ``draft_kv``, its attention on ``draft_backend`` (None: the target's), overlap
    scheduling per ``OVERLAP_FLAGS``."""
    from sgl_atom.speculative.draft_kv_dtype import to_sglang_dtype

    args = [
        "--speculative-algorithm",
        "DSPARK",
        "--speculative-draft-model-path",
        str(draft),
        # the draft's weights from its file, as ATOM_DSPARK's loader reads them, where the
        # target's --load-format dummy would give SGLang's draft random ones of its own
        "--speculative-draft-load-format",
        "auto",
        "--speculative-num-draft-tokens",
        str(block + 1),
        "--speculative-draft-kv-cache-dtype",
        to_sglang_dtype(draft_kv),
        *OVERLAP_FLAGS[overlap],
    ]
    if draft_backend:
        args += ["--speculative-draft-attention-backend", draft_backend]
    return args


def sglang_spec_env(forced: int) -> dict[str, str]:
    """SGLang's simulated acceptance committing ``forced`` drafts and the bonus token at every
    verify: SGLANG_SIMULATE_ACC_LEN = forced + 1, a whole number, so every step draws exactly
    that length; its static verify plan named (SGLANG_RAGGED_VERIFY_MODE's default), under
    which a draft without a confidence head loads and every drafted row is verified."""
    return {"SGLANG_SIMULATE_ACC_LEN": str(forced + 1), "SGLANG_RAGGED_VERIFY_MODE": "static"}


# --spec-chain: the word-chain llama target (sgl_atom.testing.tiny "llama-chain") and the draft
# distilled against it (sgl_atom/testing/assets/dspark-llama-chain), real acceptance
CHAIN_PROMPT = 64  # tokens of words per prompt
CHAIN_TARGETS = {1: 2.5, 32: 1.8}  # tokens/s over plain at batch 1 and 32
# The target learnt its chains on 160-token sequences (tools/dspark_training/train_target.py
# --seq-len) and the draft was distilled on 64 generated tokens (the asset's distill.json):
# past that the target leaves the chain, acceptance falls (on the H200: 3.1 tokens/forward over
# 256 new tokens against 4.85 over 128) and the rows would measure a drifted target, not DSpark.
CHAIN_TRAINED = 160
CHAIN_DRAFT_TRAINED = 64


def chain_output(asked: int) -> int:
    """New tokens N of the chain rows' differential rate (N and 2N decoded): ``asked``, at most
    what keeps prompt + 2N within the target's trained length."""
    return max(1, min(asked, (CHAIN_TRAINED - CHAIN_PROMPT) // 2))


def chain_target() -> Path:
    """The word-chain target checkpoint (built into the cache on first use)."""
    from sgl_atom.cpu_mode import cache_dir
    from sgl_atom.testing import tiny

    return tiny.build(cache_dir() / "tiny" / "llama-chain", "llama-chain")


def chain_prompts(target: Path, batch: int, tokens: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``tokens`` token ids each: random words of the tiny vocabulary,
    tokenized by the target's tokenizer."""
    import random

    from transformers import AutoTokenizer

    from sgl_atom.testing.tiny import _WORDS

    tok = AutoTokenizer.from_pretrained(str(target))
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        ids: list[int] = []
        while len(ids) < tokens:
            ids = tok(" ".join(rng.choice(_WORDS) for _ in range(2 * tokens)))["input_ids"]
        out.append(ids[:tokens])
    return out


def chain_table(rows: list[dict]) -> str:
    """The chain rows: plain, then DSpark per draft KV dtype, per batch, one run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import format_table

    mine = [r for r in rows if r.get("spec") in ("chain-none", "chain-dspark")]
    mine.sort(
        key=lambda r: (r["batch"], r["run"], r["spec"], r.get("draft_kv") or "", overlap_note(r))
    )
    out = []
    for r in mine:
        spec = r["spec"] == "chain-dspark"
        target = CHAIN_TARGETS.get(r["batch"])
        out.append(
            [
                f"{r['batch']}x{r['prompt']}",
                f"{r['output']} / {2 * r['output']}" if r.get("rate_method") else r["output"],
                f"ATOM_DSPARK, {r['draft_kv']} pool{overlap_note(r)}" if spec else "plain",
                r.get("accept_len", "-") if spec else 1,
                round(r["decode_tok_s"]),
                round(r["log_tok_s"]) if "log_tok_s" in r else "-",
                r.get("vs_plain", "-") if spec else "-",
                f">= {target}" if spec and target else "-",
                f"{r['same']}/{r['batch']}" if spec else "-",
                r["run"],
            ]
        )
    return format_table(
        [
            "batch x prompt",
            "new tokens",
            "serving",
            "accept len",
            "decode tok/s",
            "SGLang log tok/s",
            "vs plain",
            "target",
            "greedy equal to plain",
            "run",
        ],
        out,
    )


def spec_log_rate(log: str, batch: int) -> tuple[float, float, int]:
    """(gen throughput, mean accept len, lines) of the decode lines with the whole batch
    running, the first dropped (its interval can hold the end of the prefill). The throughput
    is time-weighted: the lines' tokens over their summed time, each line holding the same
    number of steps, so its tokens go with its accept length. Under overlap scheduling the
    time between two lines jitters (results are processed a step late, sometimes two at once),
    and a median of per-line rates would follow the jitter."""
    hits = [(float(a or 0), float(r)) for n, a, r in SPEC_RE.findall(log) if int(n) == batch][1:]
    hits = [(a, r) for a, r in hits if r > 0]
    if not hits:
        return 0.0, 0.0, 0
    weights = [a or 1.0 for a, _ in hits]
    rate = sum(weights) / sum(w / r for w, (_, r) in zip(weights, hits, strict=True))
    return rate, sum(a for a, _ in hits) / len(hits), len(hits)


def admitted(log: str, batch: int) -> int:
    """Requests of a ``batch`` that decoded together: all of them when a decode line has them
    all running, else the most any line had (a server whose admission stops short of the
    batch, as SGLang's DSpark worker runs 62 of 64 requests of 4K context, the rest queued)."""
    counts = [int(n) for n, _, _ in SPEC_RE.findall(log)]
    below = [c for c in counts if c <= batch]
    return batch if batch in counts or not below else max(below)


def step_ratio(spec_tok_s: float, accept_len: float, plain_tok_s: float) -> float:
    """Time of one draft+verify step over one plain decode step at the same batch: a step makes
    batch x accept_len tokens with speculation and batch tokens without."""
    return accept_len * plain_tok_s / spec_tok_s


def target_label(r: dict) -> str:
    """A forced-acceptance row's target: its model, and its GEMM weights where not bf16."""
    return r["model"] + (f", {r['weights']} weights" if r.get("weights") else "")


def spec_label(r: dict) -> str:
    """A forced-acceptance table row's serving: the atom plain decode ("plain"), another
    backend's ("plain, triton backend"), ATOM_DSPARK ("k=4 forced 3") or SGLang's own DSpark
    worker on a target backend ("SGLang DSPARK k=4 forced 3, triton backend"), and how many of
    the batch ran together where a server ran fewer ("..., 62 of 64 running")."""
    on = "" if r["backend"] == "atom" and r["spec"] != SGLANG_SPEC else f", {r['backend']} backend"
    if r["spec"] == "none":
        return f"plain{on}"
    if r["spec"] == SERIAL:
        return f"plain, no overlap{on}"
    who = "SGLang DSPARK " if r["spec"] == SGLANG_SPEC else ""
    ran = f", {r['running']} of {r['batch']} running" if r.get("running") else ""
    return f"{who}k={r['block']} forced {r['forced_accept']}{overlap_note(r)}{on}{ran}"


def spec_table(rows: list[dict]) -> str:
    """The DSpark rows beside the plain decode of the same run, model and workload: ATOM_DSPARK
    beside the atom backend's, SGLang's own DSpark beside its target backend's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import format_table

    kinds = {"none": 0, SERIAL: 1, "dspark": 2, SGLANG_SPEC: 3}
    mine = [r for r in rows if r.get("spec") in kinds]
    order = lambda r: (  # noqa: E731
        target_label(r),
        r["batch"],
        r["prompt"],
        r["run"],
        r["backend"] != "atom",
        r["backend"],
        kinds[r["spec"]],
        r.get("block") or 0,
        r.get("draft_kv") or "",
        overlap_note(r),
    )
    out = []
    for r in sorted(mine, key=order):
        spec = r["spec"] in ("dspark", SGLANG_SPEC)
        out.append(
            [
                target_label(r),
                f"{r['batch']}x{r['prompt']}",
                spec_label(r),
                r["draft_kv"] if spec else "-",
                r.get("accept_len", "-") if spec else 1,
                round(r["decode_tok_s"]),
                r.get("vs_plain", "-") if spec else "-",
                r.get("step_ratio", "-") if spec else "-",
                r.get("step_ratio_serial", "-") if spec else "-",
                r["ttft_s"],
                r["run"],
            ]
        )
    return format_table(
        [
            "model",
            "batch x prompt",
            "speculation",
            "draft kv",
            "accept len",
            "decode tok/s",
            "vs plain",
            f"step vs plain (target <= {STEP_TARGET})",
            "step vs plain, no overlap",
            "TTFT s",
            "run",
        ],
        out,
    )


def _grouped_bars(ax, groups: list, series: dict[str, dict], ylabel: str, title: str) -> None:
    """One group of bars per ``groups`` entry, one bar per series (label -> {group: value})."""
    width = 0.8 / max(1, len(series))
    for k, (label, got) in enumerate(series.items()):
        ax.bar(
            [i + width * (k - (len(series) - 1) / 2) for i in range(len(groups))],
            [got.get(g, 0) for g in groups],
            width,
            label=label,
        )
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def plot(rows: list[dict], path: Path) -> None:
    """Forced acceptance: one draft+verify step over a plain step per workload, a bar per draft
    KV dtype and scheduling mode (and over the plain step without overlap scheduling, where
    measured; SGLang's own DSpark over its backend's plain step), against the target. Chain
    models: tokens/s over plain per batch and draft KV dtype, against the targets. A panel only
    for the rows there are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    forced = [r for r in rows if r.get("spec") in ("dspark", SGLANG_SPEC) and "step_ratio" in r]
    chain = [r for r in rows if r.get("spec") == "chain-dspark" and "vs_plain" in r]
    panels = [p for p, got in (("forced", forced), ("chain", chain)) if got] or ["forced"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 1, 4.5), squeeze=False)
    axes = dict(zip(panels, axes[0], strict=True))
    if "forced" in axes:
        ax = axes["forced"]
        workloads = sorted({(target_label(r), r["batch"], r["prompt"]) for r in forced})
        series: dict[str, dict] = {}
        for r in forced:
            w = (target_label(r), r["batch"], r["prompt"])
            name = f"k={r['block']} {r['draft_kv']} pool{overlap_note(r)}"
            if r["spec"] == SGLANG_SPEC:
                name = f"SGLang DSPARK {name}, {r['backend']} backend"
            series.setdefault(name, {})[w] = r["step_ratio"]
            if r.get("step_ratio_serial"):
                series.setdefault(f"{name} vs plain without overlap", {})[w] = r[
                    "step_ratio_serial"
                ]
        _grouped_bars(
            ax, workloads, series, "draft+verify step / plain step", "8B shape, forced acceptance"
        )
        ax.axhline(STEP_TARGET, color="k", ls="--", lw=1, label=f"target {STEP_TARGET}")
        ax.set_xticks(
            range(len(workloads)), [f"{m}\n{b} x {p // 1024}K" for m, b, p in workloads], fontsize=8
        )
        ax.legend(fontsize=8)
    if "chain" in axes:
        ax = axes["chain"]
        batches = sorted({r["batch"] for r in chain})
        series = {}
        for r in chain:
            series.setdefault(f"{r['draft_kv']} draft KV{overlap_note(r)}", {})[r["batch"]] = r[
                "vs_plain"
            ]
        _grouped_bars(
            ax, batches, series, "tokens/s over plain",
            "chain models, real acceptance (dashed: targets)",
        )  # fmt: skip
        for i, b in enumerate(batches):
            if b in CHAIN_TARGETS:
                ax.hlines(CHAIN_TARGETS[b], i - 0.45, i + 0.45, colors="k", linestyles="--")
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
