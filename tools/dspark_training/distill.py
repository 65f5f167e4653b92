"""Distil a DSpark draft from its target's own greedy outputs, and measure it speculatively.

    PYTHONPATH=tools python -m dspark_training.distill --target DIR --draft DIR --out DIR \\
        [--device cuda --train-prompts N --max-seconds S --seed S ...]
    PYTHONPATH=tools python -m dspark_training.distill --target DIR --draft DIR --out DIR \\
        --eval-only

Training data: seed-fixed prompts (mostly random words of the tiny tokenizer's vocabulary,
like the e2e tests' ``word_prompts``, the rest from the tiny builder's sentence corpus) and the
target's greedy continuations of them, decoded in batch by the target
(:mod:`dspark_training.llama_target` over transformers, or the pure-torch
:mod:`dspark_training.m3_target`; any device). A training
example is an anchor position n among the generated tokens: context = taps of positions
0..n-1, block input = [token n, MASK x (k-1)], labels = tokens n+1..n+k (the target's greedy
choices). Every step draws a batch of sequences, runs the target once over them for the taps
and the draft at every anchor of every sequence at once (:mod:`dspark_training.anchors`).
The loss is the cross-entropy of the Markov-refined logits with the previous TRUE token fed to
the Markov head (``logits_j = U_j + W1[y_{j-1}] W2^T``, ``y_{-1}`` = the anchor): the token at
block position j is accepted only when the j before it were, and then the refinement walked
exactly those. Every draft tensor is trained (AdamW, warm-up then cosine decay); the target's
embedding and LM head stay frozen. The forward is the reference one
(:mod:`sgl_atom.speculative.dspark.reference`), batched.

Measurement, on prompts disjoint from training: :func:`evaluate` runs the step-by-step
speculative loop (draft proposes k tokens, the target verifies them greedily),
checks that its output equals plain greedy decoding, and reports tokens per forward;
:func:`dspark_training.anchors.simulate_speculative` gives the same counters for hundreds
of prompts at once (used during training and for the spread). ``tap_shift=-1`` reads the taps
one target layer too early, a corrupted context K/V write, under which acceptance collapses.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_atom.speculative.dspark import reference as ref
from sgl_atom.speculative.dspark.accept import SpecStats, greedy_accept
from sgl_atom.speculative.dspark.config import DSparkDraftConfig
from sgl_atom.speculative.dspark.weights import check_draft_weights

from .anchors import speculative_counts, teacher_forced_loss
from .llama_target import LlamaTarget
from .m3_target import TorchTarget, load_target_model

TRAIN_PROMPT_SEED = 7  # training sentences: tiny._corpus(n, seed=TRAIN_PROMPT_SEED + --seed)
TRAIN_WORD_SEED = 900_001  # training word prompts: word_prompts(n, TRAIN_WORD_SEED + --seed)
HELD_OUT_SEED = 4242  # evaluation prompts: other streams of the same generators
WEIGHTS_FILE = "model.safetensors"
COMMAND = "PYTHONPATH=tools python -m dspark_training.distill"  # recorded in distill.json
_NOT_COPIED = {WEIGHTS_FILE, "distill.json", ".sgl_atom_tiny.json"}


def corpus_prompts(n: int, seed: int) -> list[str]:
    """``n`` deterministic prompts from the tiny builder's word corpus."""
    from sgl_atom.testing.tiny import _corpus

    return _corpus(lines=n, seed=seed)


def word_prompts(n: int, seed: int, min_words: int = 4, max_words: int = 40) -> list[str]:
    """``n`` deterministic prompts of random vocabulary words (the e2e tests' generator)."""
    from sgl_atom.testing.tiny import _WORDS

    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(n)
    ]


def held_out_prompts(n: int) -> list[str]:
    """Evaluation sentences; the stream never overlaps the training prompts' seeds."""
    return corpus_prompts(n, HELD_OUT_SEED)


def held_out_word_prompts(n: int) -> list[str]:
    """Evaluation word prompts (4-40 words), a stream no training seed reaches."""
    return word_prompts(n, HELD_OUT_SEED)


def training_prompts(n: int, seed: int, word_frac: float) -> list[str]:
    """``n`` training prompts: ``word_frac`` of them 2-48 random words, the rest sentences."""
    words = round(n * word_frac)
    return word_prompts(words, TRAIN_WORD_SEED + seed, 2, 48) + corpus_prompts(
        n - words, TRAIN_PROMPT_SEED + seed
    )


# ---------------------------------------------------------------- checkpoints


def load_draft(draft_dir: Path) -> tuple[DSparkDraftConfig, dict[str, torch.Tensor]]:
    """The draft's config and float32 weights, checked against each other."""
    from safetensors.torch import load_file

    draft_dir = Path(draft_dir)
    cfg = DSparkDraftConfig.from_hf_dict(json.loads((draft_dir / "config.json").read_text()))
    weights = {k: v.float() for k, v in load_file(str(draft_dir / WEIGHTS_FILE)).items()}
    check_draft_weights(cfg, weights)
    return cfg, weights


def save_draft(out: Path, draft_dir: Path, weights: dict, info: dict) -> Path:
    """A full draft checkpoint: the source's config and tokenizer, these weights, distill.json."""
    from safetensors.torch import save_file

    out, draft_dir = Path(out), Path(draft_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(draft_dir.iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED:
            shutil.copyfile(f, out / f.name)
    tensors = {k: v.detach().float().contiguous() for k, v in sorted(weights.items())}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "distill.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


# ---------------------------------------------------------------- draft init


_LAYER_TENSORS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def init_from_target(w: dict, cfg: DSparkDraftConfig, target: TorchTarget) -> list[int]:
    """Start the draft layers from the target's last layers (same shapes needed).

    Draft layer i takes target layer ``L - num_draft_layers + i``; ``fc`` passes the last tap
    through, so the context K/V start close to those layers' own K/V of the context. Returns
    the target layers used.
    """
    if not isinstance(target, LlamaTarget):
        raise ValueError(
            f"--init target copies llama layers into the draft; this target is "
            f"{type(target).__name__}: start from the draft's own weights with --init draft"
        )
    n = target.num_layers
    used = list(range(n - cfg.num_hidden_layers, n))
    if used[0] < 0:
        raise ValueError(f"target has {n} layers, fewer than the draft's {cfg.num_hidden_layers}")
    for i, t in enumerate(used):
        for name in _LAYER_TENSORS:
            key, dst = f"model.layers.{t}.{name}.weight", f"layers.{i}.{name}.weight"
            src = target.w[key]
            if src.shape != w[dst].shape:
                raise ValueError(f"{dst} {tuple(w[dst].shape)} != target {key} {src.shape}")
            w[dst] = src.float().clone().to(w[dst].device)
    hidden = cfg.tap_hidden_size
    fc = torch.zeros_like(w["fc.weight"])
    fc[:, -hidden:] = torch.eye(hidden)
    w["fc.weight"] = fc
    return used


# ---------------------------------------------------------------- training data


@dataclass
class GreedyPool:
    """Greedy sequences on the training device: prompt + ``gen`` greedy tokens each."""

    ids: torch.Tensor  # [N, max prompt + gen] int64, right-padded
    prompt_lens: torch.Tensor  # [N] int64
    gen: int

    def __len__(self) -> int:
        return self.ids.shape[0]

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B, L] trimmed to the longest row, prompt lengths [B]) of rows ``idx``."""
        plens = self.prompt_lens[idx]
        return self.ids[idx, : int(plens.max()) + self.gen], plens

    def sequences(self) -> list[torch.Tensor]:
        lens = (self.prompt_lens + self.gen).tolist()
        return [row[:n] for row, n in zip(self.ids.cpu(), lens, strict=True)]


def build_pool(
    target: TorchTarget, prompts: list[str], gen: int, *, batch: int = 4096
) -> GreedyPool:
    """Tokenise ``prompts`` and decode ``gen`` greedy tokens after each, in batch."""
    toks = [t for t in target.encode_batch(prompts) if t]
    seqs = target.greedy_sequences(toks, gen, batch=batch)
    ids = torch.zeros(len(seqs), max(len(t) for t in toks) + gen, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    plens = torch.tensor([len(t) for t in toks])
    return GreedyPool(ids.to(target.device), plens.to(target.device), gen)


def train(
    w: dict,
    cfg: DSparkDraftConfig,
    pool: GreedyPool,
    target: TorchTarget,
    *,
    steps: int,
    seed: int,
    lr: float = 2e-3,
    batch: int = 64,
    warmup: int = 100,
    weight_decay: float = 0.0,
    max_seconds: float = 330.0,
    eval_every: int = 0,
    eval_fn=None,
    log=print,
) -> dict:
    """AdamW on every draft tensor: linear warm-up, then cosine decay to zero.

    A step draws ``batch`` pool sequences and trains on every anchor among their generated
    tokens that has k labels after it. The schedule follows whichever runs out first, steps
    or ``max_seconds``, so a capped run still ends at a low learning rate. ``eval_fn(w)``,
    when given, runs every ``eval_every`` steps and returns a dict for the log.
    """
    log = log or (lambda _: None)
    k, dev = cfg.block_size, target.device
    gen = torch.Generator().manual_seed(seed)
    params = {n: t.detach().clone().requires_grad_(True) for n, t in w.items()}
    decay = [p for n, p in params.items() if p.dim() >= 2]
    keep = [p for n, p in params.items() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    arange_a = torch.arange(pool.gen - k, device=dev)
    t0, ema, step, curve = time.time(), None, 0, []
    for step in range(1, steps + 1):
        done = min(1.0, max((step - 1) / steps, (time.time() - t0) / max_seconds))
        scale = min(1.0, step / warmup) if warmup else 1.0
        for g in opt.param_groups:
            g["lr"] = lr * scale * 0.5 * (1 + math.cos(math.pi * done))
        idx = torch.randint(0, len(pool), (batch,), generator=gen).to(dev)
        ids, plens = pool.rows(idx)
        _, taps = target.forward(ids, cfg.target_layer_ids)
        anchors = plens[:, None] + arange_a  # every anchor with k greedy labels after it
        valid = torch.ones(anchors.shape, dtype=torch.bool, device=dev)
        loss = teacher_forced_loss(
            params, cfg, taps, ids, anchors, valid, target.embed, target.lm_head
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        if step % 25 == 0 or step == 1:
            value = loss.item()
            ema = value if ema is None else 0.8 * ema + 0.2 * value
        if step % 100 == 0 or step == 1:
            log(f"[distill] step {step}/{steps} loss {ema:.4f} ({time.time() - t0:.0f}s)")
        if eval_fn is not None and eval_every and step % eval_every == 0:
            res = eval_fn({n: p.detach() for n, p in params.items()})
            curve.append({"step": step, "seconds": round(time.time() - t0, 1), **res})
            log(f"[distill] step {step} eval {res}")
        if time.time() - t0 > max_seconds:
            log(f"[distill] wall-time cap {max_seconds:.0f}s reached at step {step}")
            break
    w.update({n: p.detach() for n, p in params.items()})
    return {
        "steps_run": step,
        "final_loss": round(ema, 4),
        "train_seconds": round(time.time() - t0, 1),
        "sequences_seen": step * batch,
        "curve": curve,
    }


# ---------------------------------------------------------------- batched measurement


@dataclass
class EvalSet:
    """Held-out prompts with their greedy continuations, ready for the batched measurement."""

    name: str
    seqs: list[torch.Tensor]
    prompt_lens: list[int]
    max_new: int

    @classmethod
    def build(cls, name: str, target: TorchTarget, prompts: list[str], k: int, max_new: int):
        toks = target.encode_batch(prompts)
        seqs = target.greedy_sequences(toks, max_new + k + 1)
        return cls(name, seqs, [len(t) for t in toks], max_new)


def measure(
    target: TorchTarget,
    cfg: DSparkDraftConfig,
    w: dict,
    es: EvalSet,
    *,
    k: int,
    group: int = 16,
    tap_shift: int = 0,
) -> dict:
    """Tokens per forward on ``es`` (all prompts pooled), and its spread over groups of
    ``group`` prompts (the size :func:`evaluate` runs), from the batched measurement."""
    tap_ids = tuple(i + tap_shift for i in cfg.target_layer_ids)
    counts = speculative_counts(
        target, cfg, w, es.seqs, es.prompt_lens, k=k, max_new=es.max_new, tap_ids=tap_ids
    )
    total, per_group = SpecStats(block_size=k), []
    for c in range(0, len(counts), group):
        st = SpecStats(block_size=k)
        for one in counts[c : c + group]:
            st.update(one)
        total.merge(st)
        per_group.append(st.tokens_per_forward)
    out = {
        "prompts": len(es.seqs),
        "k": k,
        "max_new": es.max_new,
        "tap_layer_ids": list(tap_ids),
        "steps": total.steps,
        "tokens_per_forward": round(total.tokens_per_forward, 4),
        "acceptance_rate": round(total.acceptance_rate, 4),
    }
    if len(per_group) > 1:
        out[f"tpf_per_{group}_prompts"] = {
            "mean": round(statistics.mean(per_group), 4),
            "std": round(statistics.stdev(per_group), 4),
            "min": round(min(per_group), 4),
            "max": round(max(per_group), 4),
        }
    return out


# ---------------------------------------------------------------- speculative evaluation


def target_pass(target: TorchTarget, ids: list[int], tap_ids: tuple[int, ...]):
    """One full forward: (greedy next token per position [L], taps [L, taps * hidden])."""
    logits, taps = target.forward(torch.tensor([ids], device=target.device), tap_ids)
    return logits[0].argmax(dim=-1), taps[0]


def speculative_greedy(
    target: TorchTarget,
    cfg: DSparkDraftConfig,
    w: dict,
    prompt: list[int],
    *,
    k: int,
    max_new: int,
    tap_ids: tuple[int, ...],
    stats: SpecStats,
) -> list[int]:
    """Greedy decoding with the draft proposing ``k`` tokens and the target verifying them.

    Each step runs the target once over the committed tokens plus the draft block (no KV
    cache); its taps of the committed positions are the draft's next context.
    """
    greedy, taps = target_pass(target, prompt, tap_ids)
    tokens = prompt + [int(greedy[-1])]  # the last token is the anchor
    while len(tokens) - len(prompt) < max_new:
        n = len(tokens) - 1
        with torch.no_grad():
            draft, _ = ref.reference_propose(
                w,
                cfg,
                taps=taps[:n],
                anchor=tokens[n],
                embed=target.embed,
                lm_head=target.lm_head,
            )
        draft = draft[:k]
        greedy, taps = target_pass(target, tokens + draft.tolist(), tap_ids)
        acc = greedy_accept(draft[None], greedy[None, n:])
        stats.update(acc.accepted)
        tokens += acc.committed[0, : int(acc.num_committed[0])].tolist()
    return tokens[len(prompt) : len(prompt) + max_new]


def evaluate(
    target_dir: Path,
    draft_dir: Path,
    prompts: list[str],
    k: int = 4,
    max_new: int = 32,
    *,
    tap_shift: int = 0,
    check_lossless: bool = True,
) -> dict:
    """Tokens per forward and acceptance of the draft at ``draft_dir`` on ``prompts``.

    ``tap_shift`` moves every tap layer id (-1 reads each tap one target layer early); with
    ``check_lossless`` the speculative output must equal the target's plain greedy output.
    """
    target = load_target_model(target_dir)
    cfg, w = load_draft(Path(draft_dir))
    if not 1 <= k <= cfg.block_size:
        raise ValueError(f"k={k} must lie in [1, the draft's block_size={cfg.block_size}]")
    tap_ids = tuple(i + tap_shift for i in cfg.target_layer_ids)
    if min(tap_ids) < 0 or max(tap_ids) >= target.num_layers - 1:  # as a server captures
        raise ValueError(
            f"tap_shift={tap_shift} moves tap ids {list(cfg.target_layer_ids)} to "
            f"{list(tap_ids)}; they must lie in [0, {target.num_layers - 1}) (a server does "
            "not capture the last layer's output)"
        )
    stats = SpecStats(block_size=k)
    for text in prompts:
        prompt = target.encode(text)
        out = speculative_greedy(
            target, cfg, w, prompt, k=k, max_new=max_new, tap_ids=tap_ids, stats=stats
        )
        if not check_lossless:
            continue
        plain = target.greedy(torch.tensor([prompt], device=target.device), max_new)
        if out != plain[0].tolist():
            raise AssertionError(f"speculative output differs from greedy for prompt {text!r}")
    return {
        "prompts": len(prompts),
        "k": k,
        "max_new": max_new,
        "tap_layer_ids": list(tap_ids),
        "steps": stats.steps,
        "tokens_per_forward": round(stats.tokens_per_forward, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
    }


# ---------------------------------------------------------------- CLI

HELD_OUT_K = 4
WORDS_MAX_NEW = 48  # word prompts: 48 greedy tokens, as the e2e tests decode
SENTENCES_MAX_NEW = 32


def reference_figures(target_dir: Path, draft_dir: Path, out: Path, n: int) -> dict:
    """Tokens per forward from the step-by-step loop (:func:`evaluate`), lossless-checked."""
    words, sentences = held_out_word_prompts(n), held_out_prompts(n)
    return {
        "trained": evaluate(target_dir, out, sentences, HELD_OUT_K, SENTENCES_MAX_NEW),
        "trained_words": evaluate(target_dir, out, words, HELD_OUT_K, WORDS_MAX_NEW),
        "random": evaluate(target_dir, draft_dir, sentences, HELD_OUT_K, SENTENCES_MAX_NEW),
        "corrupted_taps": evaluate(
            target_dir, out, sentences, HELD_OUT_K, SENTENCES_MAX_NEW, tap_shift=-1
        ),
    }


def batched_figures(
    target: TorchTarget, cfg: DSparkDraftConfig, w: dict, info: dict, n: int
) -> dict:
    """Tokens per forward on ``n`` held-out word prompts, ``n`` held-out sentences and the first
    ``n`` training prompts of each kind, with the spread over groups of 16 prompts; then the
    held-out word prompts with the taps read one target layer early and one late."""
    seed, k = info["seed"], HELD_OUT_K
    sets = {
        "held_out_words": (held_out_word_prompts(n), WORDS_MAX_NEW),
        "held_out_sentences": (held_out_prompts(n), SENTENCES_MAX_NEW),
        "train_words": (word_prompts(n, TRAIN_WORD_SEED + seed, 2, 48), WORDS_MAX_NEW),
        "train_sentences": (corpus_prompts(n, TRAIN_PROMPT_SEED + seed), SENTENCES_MAX_NEW),
    }
    out = {}
    for name, (prompts, max_new) in sets.items():
        es = EvalSet.build(name, target, prompts, k, max_new)
        out[name] = measure(target, cfg, w, es, k=k)
    es = EvalSet.build("held_out_words", target, held_out_word_prompts(n), k, WORDS_MAX_NEW)
    out["held_out_words_corrupted_taps"] = measure(target, cfg, w, es, k=k, tap_shift=-1)
    if max(cfg.target_layer_ids) + 1 < target.num_layers:  # taps one target layer late
        out["held_out_words_shifted_taps"] = measure(target, cfg, w, es, k=k, tap_shift=1)
    return out


def _eval_only(args) -> int:
    path = args.out / "distill.json"
    info = json.loads(path.read_text())
    t0 = time.time()
    target = load_target_model(args.target)
    cfg, w = load_draft(args.out)
    info["batched"] = batched_figures(target, cfg, w, info, args.batched_eval_prompts)
    info["held_out"] = reference_figures(args.target, args.draft, args.out, args.eval_prompts)
    info["eval_command"] = f"{COMMAND} " + shlex.join(args.argv)
    info["eval_seconds"] = round(time.time() - t0, 1)
    path.write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({"held_out": info["held_out"], "batched": info["batched"]}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, type=Path, help="target checkpoint directory")
    ap.add_argument("--draft", required=True, type=Path, help="draft checkpoint to start from")
    ap.add_argument("--out", required=True, type=Path, help="trained draft directory to write")
    ap.add_argument("--device", default="cpu", help="torch device for data and training")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-prompts", type=int, default=1024)
    ap.add_argument("--word-frac", type=float, default=0.75, help="share of word prompts")
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens per train prompt")
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--max-seconds", type=float, default=330.0, help="training wall-time cap")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--tf32", action="store_true", help="TF32 matmuls while training (CUDA)")
    ap.add_argument("--eval-every", type=int, default=0, help="batched held-out eval period")
    ap.add_argument("--eval-prompts", type=int, default=16, help="step-by-step eval prompts")
    ap.add_argument("--batched-eval-prompts", type=int, default=256)
    ap.add_argument(
        "--no-reference-eval",
        action="store_true",
        help="skip the step-by-step evaluation; run --eval-only later",
    )
    ap.add_argument(
        "--eval-only",
        action="store_true",
        help="measure the draft already in --out and rewrite its distill.json figures",
    )
    ap.add_argument(
        "--init",
        choices=("target", "draft"),
        default="target",
        help="start the draft layers from the target's last layers, or from --draft's weights",
    )
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    if args.eval_only:
        return _eval_only(args)
    torch.manual_seed(args.seed)
    t0 = time.time()
    device = torch.device(args.device)
    target = load_target_model(args.target, device)
    cfg, w = load_draft(args.draft)
    w = {n: t.to(device) for n, t in w.items()}
    init_layers = init_from_target(w, cfg, target) if args.init == "target" else []
    prompts = training_prompts(args.train_prompts, args.seed, args.word_frac)
    pool = build_pool(target, prompts, args.gen_tokens)
    print(f"[distill] {len(pool)} greedy sequences on {device} ({time.time() - t0:.0f}s)")
    quick = EvalSet.build(
        "held_out_words", target, held_out_word_prompts(128), HELD_OUT_K, WORDS_MAX_NEW
    )

    def eval_fn(weights):
        return {
            "held_out_words_tpf": measure(target, cfg, weights, quick, k=HELD_OUT_K)[
                "tokens_per_forward"
            ]
        }

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    try:
        result = train(
            w,
            cfg,
            pool,
            target,
            steps=args.steps,
            seed=args.seed,
            lr=args.lr,
            batch=args.batch,
            warmup=args.warmup,
            weight_decay=args.weight_decay,
            max_seconds=args.max_seconds,
            eval_every=args.eval_every,
            eval_fn=eval_fn,
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    info = {
        "command": f"{COMMAND} " + shlex.join(args.argv),
        "seed": args.seed,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "steps": args.steps,
        "threads": args.threads,
        "init": args.init,
        "init_target_layers": init_layers,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "batch": args.batch,
        "tf32": args.tf32,
        "train_prompts": len(pool),
        "word_frac": args.word_frac,
        "train_word_seed": TRAIN_WORD_SEED + args.seed,
        "train_prompt_seed": TRAIN_PROMPT_SEED + args.seed,
        "gen_tokens": args.gen_tokens,
        **result,
    }
    cpu_w = {n: t.detach().cpu() for n, t in w.items()}
    save_draft(args.out, args.draft, cpu_w, info)
    info["batched"] = batched_figures(target, cfg, w, info, args.batched_eval_prompts)
    if not args.no_reference_eval:
        info["held_out"] = reference_figures(args.target, args.draft, args.out, args.eval_prompts)
    info["wall_seconds"] = round(time.time() - t0, 1)
    save_draft(args.out, args.draft, cpu_w, info)
    print(json.dumps({k: info.get(k) for k in ("batched", "held_out")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
