"""Distil a DSpark draft from its target's own greedy outputs, and measure it speculatively.

    python -m sgl_atom.spec.dspark.distill --target DIR --draft DIR --out DIR \\
        [--steps N --seed S --threads T]

Training data: the target (transformers, float32, CPU) continues seed-fixed prompts from the
tiny builder's word corpus greedily; one forward over each finished sequence gives its taps
(:func:`~sgl_atom.spec.dspark.reference.taps_from_hidden_states`). A training example is an
anchor position n among the generated tokens: context = taps of positions 0..n-1, block input
= [token n, MASK x (k-1)], labels = tokens n+1..n+k (the target's greedy choices). The loss is
the cross-entropy of the Markov-refined logits with the previous TRUE token fed to the Markov
head (``logits_j = U_j + W1[y_{j-1}] W2^T``, ``y_{-1}`` = the anchor). Every draft tensor is
trained (Adam); the target's embedding and LM head stay frozen. The forward is the reference
one (:mod:`sgl_atom.spec.dspark.reference`).

:func:`evaluate` runs a pure-torch speculative loop (draft proposes k tokens, the target
verifies them greedily) on held-out prompts, checks that its output equals plain greedy
decoding, and reports tokens per forward. ``tap_shift=-1`` reads the taps one target layer too
early, a corrupted context K/V write, under which acceptance collapses.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_atom.spec.dspark import reference as ref
from sgl_atom.spec.dspark.accept import SpecStats, greedy_accept
from sgl_atom.spec.dspark.config import DSparkDraftConfig
from sgl_atom.spec.dspark.markov import markov_step_logits
from sgl_atom.spec.dspark.weights import check_draft_weights

TRAIN_PROMPT_SEED = 7  # training prompts: tiny._corpus(n, seed=TRAIN_PROMPT_SEED + --seed)
HELD_OUT_SEED = 4242  # evaluation prompts: a different stream of the same corpus
WEIGHTS_FILE = "model.safetensors"
_NOT_COPIED = {WEIGHTS_FILE, "distill.json", ".sgl_atom_tiny.json"}


def corpus_prompts(n: int, seed: int) -> list[str]:
    """``n`` deterministic prompts from the tiny builder's word corpus."""
    from sgl_atom.testing.tiny import _corpus

    return _corpus(lines=n, seed=seed)


def held_out_prompts(n: int) -> list[str]:
    """Evaluation prompts; the stream never overlaps the training prompts' seeds."""
    return corpus_prompts(n, HELD_OUT_SEED)


# ---------------------------------------------------------------- checkpoints


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]


def load_target(target_dir: Path) -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model.requires_grad_(False)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    return Target(model, AutoTokenizer.from_pretrained(target_dir), embed, head)


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


# ---------------------------------------------------------------- target passes


@torch.no_grad()
def target_pass(target: Target, ids: list[int], tap_ids: tuple[int, ...]):
    """One full forward: (greedy next token per position [L], taps [L, taps * hidden])."""
    out = target.model(torch.tensor([ids]), output_hidden_states=True)
    taps = ref.taps_from_hidden_states(out.hidden_states, tap_ids)[0]
    return out.logits[0].argmax(dim=-1), taps


@torch.no_grad()
def greedy_batch(target: Target, prompts: torch.Tensor, max_new: int) -> torch.Tensor:
    """Greedy continuations [batch, max_new] of equal-length ``prompts`` [batch, P], KV-cached,
    with no stop token."""
    out = target.model(prompts, use_cache=True)
    new = [out.logits[:, -1].argmax(dim=-1)]
    while len(new) < max_new:
        out = target.model(new[-1][:, None], past_key_values=out.past_key_values)
        new.append(out.logits[:, -1].argmax(dim=-1))
    return torch.stack(new, dim=1)


def plain_greedy(target: Target, prompt: list[int], max_new: int) -> list[int]:
    """The target's greedy continuation of one prompt."""
    return greedy_batch(target, torch.tensor([prompt]), max_new)[0].tolist()


@dataclass
class GreedySequence:
    ids: torch.Tensor  # [L] prompt + greedy continuation
    prompt_len: int
    taps: torch.Tensor  # [L, taps * hidden]


def build_sequences(
    target: Target, prompts: list[str], tap_ids: tuple[int, ...], max_new: int
) -> list[GreedySequence]:
    """Greedy continuations and their taps; prompts of one token length run as one batch."""
    by_len: dict[int, list[list[int]]] = {}
    for text in prompts:
        ids = target.encode(text)
        by_len.setdefault(len(ids), []).append(ids)
    seqs = []
    for plen, group in sorted(by_len.items()):
        batch = torch.tensor(group)
        ids = torch.cat([batch, greedy_batch(target, batch, max_new)], dim=1)
        with torch.no_grad():
            hidden = target.model(ids, output_hidden_states=True).hidden_states
        taps = ref.taps_from_hidden_states(hidden, tap_ids)
        seqs += [GreedySequence(ids[i], plen, taps[i]) for i in range(len(group))]
    return seqs


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


def init_from_target(w: dict, cfg: DSparkDraftConfig, target: Target) -> list[int]:
    """Start the draft layers from the target's last layers (same shapes needed).

    Draft layer i takes target layer ``L - num_draft_layers + i``; ``fc`` passes the last tap
    through, so the context K/V start close to those layers' own K/V of the context. Returns
    the target layers used.
    """
    n = len(target.model.model.layers)
    used = list(range(n - cfg.num_hidden_layers, n))
    if used[0] < 0:
        raise ValueError(f"target has {n} layers, fewer than the draft's {cfg.num_hidden_layers}")
    src = target.model.state_dict()
    for i, t in enumerate(used):
        for name in _LAYER_TENSORS:
            key, dst = f"model.layers.{t}.{name}.weight", f"layers.{i}.{name}.weight"
            if src[key].shape != w[dst].shape:
                raise ValueError(f"{dst} {tuple(w[dst].shape)} != target {key} {src[key].shape}")
            w[dst] = src[key].float().clone()
    hidden = cfg.tap_hidden_size
    fc = torch.zeros_like(w["fc.weight"])
    fc[:, -hidden:] = torch.eye(hidden)
    w["fc.weight"] = fc
    return used


# ---------------------------------------------------------------- training


def _masked_attention(q, k, v, mask, cfg: DSparkDraftConfig) -> torch.Tensor:
    """:func:`reference._attention` with a [nq, nk] bool mask of the keys each query sees."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_dim**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).reshape(q.shape[0], -1)


def _masked_layer(w, cfg, i, x, positions, ctx_k, ctx_v, mask) -> torch.Tensor:
    # reference._layer over many blocks at once; the mask keeps each block to its own rows
    p, eps = f"layers.{i}.", cfg.rms_norm_eps
    h = ref.rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q = ref._heads(h @ w[p + "self_attn.q_proj.weight"].T, cfg.num_attention_heads, cfg)
    q = ref.rope(ref.rms_norm(q, w[p + "self_attn.q_norm.weight"], eps), positions, cfg.rope_theta)
    k, v = ref._kv(w, cfg, i, h, positions)
    attn = _masked_attention(q, torch.cat([ctx_k, k]), torch.cat([ctx_v, v]), mask, cfg)
    x = x + attn @ w[p + "self_attn.o_proj.weight"].T
    h = ref.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def batched_base_logits(w, cfg: DSparkDraftConfig, taps, ids, anchors: torch.Tensor, embed, head):
    """Base logits [m, k, vocab] of m draft passes over one sequence, anchors at ``anchors`` [m].

    Equals :func:`reference.reference_base_logits` for each anchor n (context = taps of
    positions 0..n-1, block = [ids[n], MASK x (k-1)]); one pass for all, for training speed.
    """
    m, q = anchors.shape[0], cfg.query_len
    kv = ref.reference_context_kv(w, cfg, taps, torch.arange(taps.shape[0]))
    block = ref.block_input_ids(ids[anchors], cfg).reshape(-1)
    positions = (anchors[:, None] + torch.arange(q)).reshape(-1)
    owner = torch.arange(m).repeat_interleave(q)
    sees_ctx = torch.arange(taps.shape[0])[None, :] < anchors[owner][:, None]
    mask = torch.cat([sees_ctx, owner[:, None] == owner[None, :]], dim=1)
    x = embed[block]
    for i, (ck, cv) in enumerate(kv):
        x = _masked_layer(w, cfg, i, x, positions, ck, cv, mask)
    logits = (ref.rms_norm(x, w["norm.weight"], cfg.rms_norm_eps) @ head.T).view(m, q, -1)
    return logits if cfg.sample_from_anchor else logits[:, 1:]


def block_loss(w, cfg: DSparkDraftConfig, seq: GreedySequence, anchors: list[int], embed, head):
    """Summed teacher-forced cross-entropy of the refined logits over blocks at ``anchors``."""
    k, at = cfg.block_size, torch.tensor(anchors)
    base = batched_base_logits(w, cfg, seq.taps, seq.ids, at, embed, head)
    offsets = at[:, None] + torch.arange(k)
    prev, labels = seq.ids[offsets], seq.ids[offsets + 1]  # [m, k]: y_{j-1} and y_j
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    logits = markov_step_logits(base.reshape(-1, cfg.vocab_size), prev.reshape(-1), w1, w2)
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="sum")


def _anchors(seq: GreedySequence, k: int, count: int, gen: torch.Generator) -> list[int]:
    # anchor n is a generated token (n >= prompt_len) with k labels after it
    lo, hi = seq.prompt_len, len(seq.ids) - k
    return torch.randint(lo, hi, (count,), generator=gen).tolist()


def train(
    w: dict,
    cfg: DSparkDraftConfig,
    seqs: list[GreedySequence],
    target: Target,
    *,
    steps: int,
    seed: int,
    lr: float = 2e-3,
    seqs_per_step: int = 8,
    anchors_per_seq: int = 16,
    max_seconds: float = 330.0,
    log=print,
) -> dict:
    """Adam on every draft tensor, cosine-decayed; stops at ``steps`` or ``max_seconds``.

    The schedule follows whichever runs out first, steps or seconds, so a capped run still
    ends at a low learning rate.
    """
    gen = torch.Generator().manual_seed(seed)
    params = {n: t.clone().requires_grad_(True) for n, t in w.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    t0, ema, step = time.time(), None, 0
    for step in range(1, steps + 1):
        done = min(1.0, max((step - 1) / steps, (time.time() - t0) / max_seconds))
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * done))
        picks = torch.randint(0, len(seqs), (seqs_per_step,), generator=gen).tolist()
        loss = sum(
            block_loss(
                params,
                cfg,
                seqs[i],
                _anchors(seqs[i], cfg.block_size, anchors_per_seq, gen),
                target.embed,
                target.lm_head,
            )
            for i in picks
        ) / (seqs_per_step * anchors_per_seq * cfg.block_size)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 50 == 0 or step == 1:
            log(f"[distill] step {step}/{steps} loss {ema:.4f} ({time.time() - t0:.0f}s)")
        if time.time() - t0 > max_seconds:
            log(f"[distill] wall-time cap {max_seconds:.0f}s reached at step {step}")
            break
    w.update({n: p.detach() for n, p in params.items()})
    return {"steps_run": step, "final_loss": round(ema, 4), "train_seconds": time.time() - t0}


# ---------------------------------------------------------------- speculative evaluation


def speculative_greedy(
    target: Target,
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
    target = load_target(Path(target_dir))
    cfg, w = load_draft(Path(draft_dir))
    if not 1 <= k <= cfg.block_size:
        raise ValueError(f"k={k} must lie in [1, the draft's block_size={cfg.block_size}]")
    tap_ids = tuple(i + tap_shift for i in cfg.target_layer_ids)
    if min(tap_ids) < 0:
        raise ValueError(f"tap_shift={tap_shift} moves tap ids {cfg.target_layer_ids} below 0")
    stats = SpecStats(block_size=k)
    for text in prompts:
        prompt = target.encode(text)
        out = speculative_greedy(
            target, cfg, w, prompt, k=k, max_new=max_new, tap_ids=tap_ids, stats=stats
        )
        if check_lossless and out != plain_greedy(target, prompt, max_new):
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, type=Path, help="target checkpoint directory")
    ap.add_argument("--draft", required=True, type=Path, help="draft checkpoint to start from")
    ap.add_argument("--out", required=True, type=Path, help="trained draft directory to write")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-prompts", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens per train prompt")
    ap.add_argument("--max-seconds", type=float, default=330.0, help="training wall-time cap")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument(
        "--init",
        choices=("target", "draft"),
        default="target",
        help="start the draft layers from the target's last layers, or from --draft's weights",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    target = load_target(args.target)
    cfg, w = load_draft(args.draft)
    init_layers = init_from_target(w, cfg, target) if args.init == "target" else []
    prompts = corpus_prompts(args.train_prompts, TRAIN_PROMPT_SEED + args.seed)
    seqs = build_sequences(target, prompts, cfg.target_layer_ids, args.gen_tokens)
    print(f"[distill] {len(seqs)} greedy sequences ({time.time() - t0:.0f}s)")
    result = train(
        w,
        cfg,
        seqs,
        target,
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        max_seconds=args.max_seconds,
    )
    info = {
        "command": "python -m sgl_atom.spec.dspark.distill " + shlex.join(argv or sys.argv[1:]),
        "seed": args.seed,
        "steps": args.steps,
        "threads": args.threads,
        "init": args.init,
        "init_target_layers": init_layers,
        "lr": args.lr,
        "train_prompts": args.train_prompts,
        "train_prompt_seed": TRAIN_PROMPT_SEED + args.seed,
        "gen_tokens": args.gen_tokens,
        **result,
    }
    save_draft(args.out, args.draft, w, info)
    held_out = held_out_prompts(args.eval_prompts)
    info["held_out"] = {
        "trained": evaluate(args.target, args.out, held_out),
        "random": evaluate(args.target, args.draft, held_out),
        "corrupted_taps": evaluate(args.target, args.out, held_out, tap_shift=-1),
    }
    info["wall_seconds"] = round(time.time() - t0, 1)
    save_draft(args.out, args.draft, w, info)
    print(json.dumps(info["held_out"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
