"""Deterministic tiny checkpoints with a locally trained tokenizer (no model hub).

    python -m sgl_atom.testing.tiny --out DIR --kind llama

Each kind writes a complete HF-style checkpoint (config.json, safetensors weights, tokenizer
files). A finished build leaves a stamp; running again with the same spec does nothing. A
build goes to a temporary sibling directory and is renamed into place, so an interrupted build
never leaves a half-written checkpoint; an exclusive lock beside it lets several processes (test
workers) ask for the same checkpoint at once, one building while the others wait.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

STAMP = ".sgl_atom_tiny.json"
BUILDER_VERSION = 1

_WORDS = (
    "the a one two three four five six seven eight nine ten red green blue small large fast "
    "slow cat dog bird fish tree river hill city road house light night day sun moon star sky "
    "water fire stone wind rain snow cloud and or but with from into over under near far up "
    "down left right is was are were has had will can may run walk fly swim read write sing "
    "play build open close give take make find keep hold turn start stop answer question "
    "number model token cache page server request reply hello world paris france capital of "
    "what who where when why how"
).split()


def _corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, n), str(rng.randint(0, 999)))
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int) -> int:
    """Train a byte-level BPE tokenizer on a generated corpus; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


def _llama(out: Path, vocab: int, spec: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec["hidden"],
        intermediate_size=spec["hidden"] * 2,
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["hidden"] // spec["heads"],
        max_position_embeddings=spec["max_pos"],
        initializer_range=spec["init_range"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    torch.manual_seed(spec["seed"])
    model = LlamaForCausalLM(cfg).to(torch.float32)
    if "outliers" in spec:
        _add_kv_outliers(model, cfg.head_dim, **spec["outliers"])
    model.save_pretrained(out, safe_serialization=True)


def _dspark(out: Path, vocab: int, spec: dict) -> None:
    """A random DSpark draft for the target kind whose spec is ``spec["target"]`` (its hidden
    size, layer count and context length): taps, projection, draft layers, Markov head.

    The tokenizer written beside it is the target's (every kind trains the same one); the
    draft borrows the target's embedding and LM head, so neither is in this checkpoint. Its
    head_dim is the target's hidden size over the draft's ``heads``.
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from sgl_atom.speculative.dspark.config import DSparkDraftConfig
    from sgl_atom.speculative.dspark.weights import init_draft_weights

    target = spec["target"]
    mask_id = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(spec["mask_token"])
    cfg = DSparkDraftConfig(
        architecture=spec["architecture"],
        hidden_size=target["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=target["hidden"] // spec["heads"],
        intermediate_size=spec["intermediate"],
        vocab_size=vocab,
        block_size=spec["block_size"],
        target_layer_ids=tuple(spec["target_layer_ids"]),
        num_target_layers=target["layers"],
        mask_token_id=mask_id,
        markov_rank=spec["markov_rank"],
        rms_norm_eps=1e-5,
        max_position_embeddings=target["max_pos"],
        target_hidden_size=target["hidden"],
    )
    cfg = DSparkDraftConfig.from_hf_dict(cfg.to_hf_dict())  # validates what is written
    extra = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    extra |= dict(hidden_act="silu", attention_bias=False, torch_dtype="float32")
    hf = cfg.to_hf_dict() | extra
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    weights = init_draft_weights(cfg, seed=spec["seed"], init_range=spec["init_range"])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def m3_config(vocab: int, spec: dict) -> dict:
    """config.json of the ``m3`` kind: the fields SGLang 0.5.23's MiniMaxM3SparseForCausalLM
    reads (models/minimax_m3.py), plus ATOM's top-level index-reuse fields."""
    layers = spec["layers"]
    sparse = list(spec["sparse_freq"])
    attn = dict(
        hidden_size=spec["hidden"],
        num_hidden_layers=layers,
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        rotary_dim=spec["rotary_dim"],
        rope_theta=10000.0,
        max_position_embeddings=spec["max_pos"],
        rms_norm_eps=1e-6,
        use_gemma_norm=True,
        use_qk_norm=True,
        qk_norm_type="per_head",
    )
    moe = dict(
        hidden_act="silu",
        swiglu_alpha=None,  # read unconditionally by MiniMaxM3MoE; None: plain SiLU-and-mul
        swiglu_limit=None,
        num_local_experts=spec["experts"],
        num_experts_per_tok=spec["top_k"],
        intermediate_size=spec["intermediate"],
        dense_intermediate_size=spec["dense_intermediate"],
        moe_layer_freq=list(spec["moe_freq"]),
        n_shared_experts=spec["shared_experts"],
        scoring_func="sigmoid",
        use_routing_bias=True,
        routed_scaling_factor=spec["routed_scaling"],
    )
    sparse_cfg = dict(
        sparse_attention_freq=sparse,
        sparse_disable_index_value=sparse,  # index value off on every sparse layer
        sparse_block_size=128,
        sparse_topk_blocks=spec["topk_blocks"],
        sparse_init_block=1,
        sparse_local_block=1,
        sparse_num_index_heads=spec["kv_heads"],
        sparse_index_dim=spec["index_dim"],
        sparse_score_type="max",
    )
    return dict(
        architectures=["MiniMaxM3SparseForCausalLM"],
        model_type="minimax_m2",
        vocab_size=vocab,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="bfloat16",
        sparse_attention_config=sparse_cfg,
        use_index_cache=True,
        index_topk_freq=spec["index_topk_freq"],
        **attn,
        **moe,
    )


def m3_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape, under the names MiniMaxM3SparseForCausalLM.load_weights maps."""
    h, hd, e = cfg["hidden_size"], cfg["head_dim"], cfg["num_local_experts"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    sc = cfg["sparse_attention_config"]
    idim, inter = sc["sparse_index_dim"], cfg["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        a = p + "self_attn."
        shapes |= {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h)}
        shapes |= {a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q)}
        shapes |= {a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
        if sc["sparse_attention_freq"][i]:
            shapes[a + "index_q_proj.weight"] = (sc["sparse_num_index_heads"] * idim, h)
            shapes[a + "index_k_proj.weight"] = (idim, h)
            shapes |= {a + "index_q_norm.weight": (idim,), a + "index_k_norm.weight": (idim,)}
        if not cfg["moe_layer_freq"][i]:
            shapes |= _mlp_shapes(p + "mlp.", h, cfg["dense_intermediate_size"])
            continue
        m = p + "block_sparse_moe."
        shapes |= {m + "gate.weight": (e, h), m + "e_score_correction_bias": (e,)}
        for x in range(e):
            shapes |= {
                m + f"experts.{x}.w1.weight": (inter, h),
                m + f"experts.{x}.w3.weight": (inter, h),
            }
            shapes[m + f"experts.{x}.w2.weight"] = (h, inter)
        if cfg["n_shared_experts"]:
            shapes |= _mlp_shapes(m + "shared_experts.", h, inter * cfg["n_shared_experts"])
    return shapes


def _mlp_shapes(prefix: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, h),
        prefix + "up_proj.weight": (inter, h),
        prefix + "down_proj.weight": (h, inter),
    }


def _m3(out: Path, vocab: int, spec: dict) -> None:
    """A random MiniMax-M3-style checkpoint (bf16), written name by name with safetensors.

    Norm weights are Gemma-style (the model scales by ``1 + w``), so they are drawn near 0.
    """
    import torch
    from safetensors.torch import save_file

    cfg = m3_config(vocab, spec)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = torch.Generator().manual_seed(spec["seed"])
    weights = {}
    for name, shape in m3_weight_shapes(cfg).items():
        std = spec["norm_range"] if len(shape) == 1 else spec["init_range"]
        w = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        weights[name] = w.to(torch.bfloat16)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def m3_variant(base: Path, out: Path, sparse: dict | None = None, **top) -> Path:
    """A copy of the ``m3`` checkpoint at ``base`` whose config.json has ``sparse`` merged into
    ``sparse_attention_config`` and ``top`` into the top level; weights and tokenizer are the
    same bytes. Idempotent (stamped with the base's stamp and the overrides), written to a
    temporary sibling and renamed into place like :func:`build`.

    ``m3_variant(b, o, {"sparse_topk_blocks": 4})`` attends every block of a 3-block prompt;
    ``m3_variant(b, o, {"sparse_attention_freq": [0] * layers})`` serves every layer dense (the
    model then skips the index projections of the checkpoint)."""
    base, out = Path(base).resolve(), Path(out).resolve()
    overrides = {"sparse": sparse or {}, "top": top}
    blob = json.dumps({"base": (base / STAMP).read_text(), **overrides}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    stamp = out / STAMP
    with _locked(out):
        if stamp.exists() and json.loads(stamp.read_text()).get("digest") == digest:
            return out
        cfg = json.loads((base / "config.json").read_text())
        cfg["sparse_attention_config"] = {**cfg["sparse_attention_config"], **(sparse or {})}
        _write_copy(base, out, cfg | top, {"kind": "m3-variant", "digest": digest})
    return out


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out``'s build (a ``.<name>.lock`` file beside it)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        f = open(out.parent / f".{out.name}.lock", "a")  # closed by the with below
    except OSError as e:
        raise SystemExit(
            f"cannot write the tiny checkpoint under {out.parent} ({e.strerror}): "
            "choose a writable --out or set SGL_ATOM_CACHE_DIR"
        ) from e
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move a finished checkpoint ``tmp`` to ``out``, replacing what was there."""
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _write_copy(base: Path, out: Path, cfg: dict, stamp: dict) -> None:
    """``base``'s files with ``cfg`` as config.json, built beside ``out`` and renamed into it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for f in base.iterdir():
            if f.is_file() and f.name not in (STAMP, "config.json"):
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / STAMP).write_text(json.dumps(stamp))
        _replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _add_kv_outliers(model, head_dim: int, k_channels: tuple, k_gain: float, v_gain: float):
    """Give K a few large channels per head and V a small range, as trained models have.

    Random weights give K/V values of about one everywhere, where one fp8 scale of 1.0 for the
    whole tensor is as good as any; real models have a few outlier K channels (clipped at 448
    by a unit scale) and layers whose values sit near fp8's subnormal range.
    """
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            heads = attn.k_proj.weight.shape[0] // head_dim
            rows = [h * head_dim + c for h in range(heads) for c in k_channels]
            attn.k_proj.weight[rows] *= k_gain
            attn.v_proj.weight *= v_gain


KINDS: dict[str, tuple[dict, Callable[[Path, int, dict], None]]] = {
    "llama": (
        dict(
            hidden=256,
            layers=4,
            heads=4,
            kv_heads=2,
            max_pos=4096,
            init_range=0.05,
            seed=0,
            vocab=512,
        ),
        _llama,
    ),
    "llama-hd32": (
        dict(
            hidden=128,
            layers=2,
            heads=4,
            kv_heads=2,
            max_pos=4096,
            init_range=0.05,
            seed=0,
            vocab=512,
        ),
        _llama,
    ),
    # two layers, one KV head: the atom e2e tests run its kernels in Triton's interpreter
    "llama-outliers": (
        dict(
            hidden=256,
            layers=2,
            heads=4,
            kv_heads=1,
            max_pos=4096,
            init_range=0.05,
            seed=0,
            vocab=512,
            outliers=dict(k_channels=(3, 40), k_gain=200.0, v_gain=0.02),
        ),
        _llama,
    ),
}

# A DSpark draft for the "llama" target. Taps stop below the target's last layer, whose output
# SGLang's Llama does not capture; MASK is <pad>, a token generation never produces.
KINDS["dspark"] = (
    dict(
        target=dict(KINDS["llama"][0]),
        architecture="AtomDSparkDraftModel",
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=512,
        block_size=4,
        target_layer_ids=[1, 2],
        markov_rank=32,
        mask_token="<pad>",
        init_range=0.05,
        seed=1,
        vocab=512,
    ),
    _dspark,
)


def _asset(out: Path, vocab: int, spec: dict) -> None:
    """A committed checkpoint (``sgl_atom/testing/assets/<asset>``) copied over the built
    tokenizer; its weights must hash to ``spec["sha256"]``."""
    src = Path(__file__).parent / "assets" / spec["asset"]
    digest = hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    if digest != spec["sha256"]:
        raise ValueError(f"{src}/model.safetensors: sha256 {digest} != {spec['sha256']}")
    for f in sorted(src.iterdir()):
        if f.is_file():
            shutil.copyfile(f, out / f.name)


# The "llama" architecture trained as a language model of a sparse order-2 word chain
# (tools/dspark_training/train_target.py; figures in its train_target.json): its greedy
# continuation of any word prompt follows the chain, so a DSpark draft can predict it.
KINDS["llama-chain"] = (
    dict(
        asset="llama-chain-target",
        sha256="a59df2f6a5d78a02b7c03f25f369414a21006ef00f7038cece420d2a19532671",
        vocab=512,
        seed=0,
    ),
    _asset,
)

# A MiniMax-M3-style sparse-attention MoE. Layer 0: dense attention, dense MLP;
# layers 1-3: sparse attention (ordinal 1 reuses ordinal 0's selection) and MoE.
KINDS["m3"] = (
    dict(
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=128,
        rotary_dim=64,
        max_pos=4096,
        experts=4,
        top_k=2,
        intermediate=64,
        dense_intermediate=256,
        shared_experts=1,
        routed_scaling=2.0,
        moe_freq=[0, 1, 1, 1],
        sparse_freq=[0, 1, 1, 1],
        topk_blocks=2,
        index_dim=128,  # real M3 checkpoints (and SGLang's class) use 128
        index_topk_freq=2,
        init_range=0.05,
        norm_range=0.1,
        seed=2,
        vocab=512,
    ),
    _m3,
)


# The "m3" architecture trained on the same word chain (train_target.py from the m3 kind's seeded
# weights, dense attention over 256-token sequences; figures in its train_target.json).
KINDS["m3-chain"] = (
    dict(
        asset="m3-chain-target",
        sha256="9b45ee312d387d6437de50dec4d787a270582f47cb1c25e4c663aa141a9b7f0f",
        vocab=512,
        seed=0,
    ),
    _asset,
)


def _dspark_for(target: str, **over) -> dict:
    """The ``dspark`` kind's draft spec for the target kind ``target``, with ``over`` applied."""
    spec = {k: v for k, v in KINDS["dspark"][0].items() if k != "target"}
    return dict(target=dict(KINDS[target][0]), **(spec | over))


# A DSpark draft for the "m3" target (MHA: its own KV pool). Taps [1, 2] stop below the last of
# the target's 4 layers; head_dim 64 = the target's hidden 128 over 2 heads.
KINDS["m3-dspark"] = (_dspark_for("m3", heads=2, kv_heads=2, intermediate=256, seed=3), _dspark)


def _spec_digest(kind: str, spec: dict) -> str:
    blob = json.dumps({"kind": kind, "spec": spec, "v": BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_built(out: Path, kind: str) -> bool:
    """True when ``out`` holds a finished checkpoint of this kind and builder version."""
    stamp = out / STAMP
    if not stamp.exists():
        return False
    try:
        return json.loads(stamp.read_text()).get("digest") == _spec_digest(kind, KINDS[kind][0])
    except (OSError, ValueError):
        return False


def build(out: Path, kind: str = "llama", log: Callable[[str], None] = print) -> Path:
    """Build the tiny checkpoint ``kind`` into ``out`` unless it is already there."""
    if kind not in KINDS:
        raise ValueError(f"unknown tiny checkpoint kind {kind!r}; choose from {sorted(KINDS)}")
    out = Path(out).resolve()
    with _locked(out):
        return _build(out, kind, log)


def _build(out: Path, kind: str, log: Callable[[str], None]) -> Path:
    spec, make_model = KINDS[kind]
    if is_built(out, kind):
        log(f"[tiny] {kind} checkpoint already built at {out}")
        return out
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    except OSError as e:
        raise SystemExit(
            f"cannot write the tiny checkpoint under {out.parent} ({e.strerror}): "
            "choose a writable --out or set SGL_ATOM_CACHE_DIR"
        ) from e
    t0 = time.time()
    try:
        log(f"[tiny] 1/3 training a {spec['vocab']}-token BPE tokenizer")
        vocab = build_tokenizer(tmp, spec["vocab"])
        log(f"[tiny] 2/3 writing {kind} weights (seed {spec['seed']})")
        make_model(tmp, vocab, spec)
        (tmp / STAMP).write_text(json.dumps({"kind": kind, "digest": _spec_digest(kind, spec)}))
        log("[tiny] 3/3 moving into place")
        _replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"[tiny] {kind} checkpoint ready at {out} ({time.time() - t0:.1f}s)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    ap.add_argument("--kind", default="llama", choices=sorted(KINDS))
    args = ap.parse_args(argv)
    build(args.out, args.kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
