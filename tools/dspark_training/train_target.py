"""Train a predictable tiny target (Llama or M3): a language model of a sparse order-2 word chain.

    PYTHONPATH=tools python -m dspark_training.train_target --base DIR --out DIR \\
        [--device cuda --max-seconds S --seed S ...]

The language (:class:`WordChain`, fixed by ``--chain-seed``) is over the tiny tokenizer's word
vocabulary (``tiny._WORDS``, 108 words). Every word has a class (4 classes of 27 words); the
next word depends on the current word and on the CLASS of the word before it, so on more than
the last token: after the pair ``(a, b)`` it is drawn from 1-3 successors of
``(class(a), b)``, the first of them (the chain's choice, probability 0.6-1.0) picked so that
``(class(a), b) -> (class(b), next)`` is a permutation of the 432 states. Greedy decoding of a
model of this chain therefore walks long state cycles (no collapse onto a short loop), and the
four predecessor classes give every word four different likely successors.

A training sequence is a random-word prefix (2-48 words drawn uniformly, like the e2e tests'
``word_prompts``) followed by a chain continuation seeded by the prefix's last two words; the
loss covers the continuation only, so after ANY prompt the model continues the chain. The
model is ``--base``'s architecture (config and tokenizer copied from it): a llama config starts
from a seeded init copied into transformers' ``LlamaForCausalLM``
(:class:`~dspark_training.llama_target.LlamaTarget`); an M3 config starts from ``--base``'s
weights and runs :class:`~dspark_training.m3_target.M3Target`'s layers (dense attention, so
``--seq-len`` may not pass its ``dense_exact_tokens``). Trained with
AdamW (bf16 autocast on CUDA) under a warm-up then cosine schedule capped by steps or
``--max-seconds``, and saved as float16 safetensors with ``train_target.json`` (seed, command,
figures: held-out loss against the chain's entropy floor, agreement of the argmax with the
chain's choice, and how often greedy continuations of held-out word prompts follow it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .llama_target import LlamaTarget
from .m3_target import M3_MODEL_TYPE, M3Target, TorchTarget, load_target_model

NUM_CLASSES = 4
SUCCESSOR_PROBS = {1: (1.0,), 2: (0.7, 0.3), 3: (0.6, 0.25, 0.15)}
MAX_WORD_TOKENS = 3
INFO_FILE = "train_target.json"
_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class WordChain:
    """The order-2 word chain and the tokens of every word, as tensors on ``device``."""

    def __init__(self, seed: int, tokenizer, device: str | torch.device = "cpu"):
        from sgl_atom.testing.tiny import _WORDS

        words = list(_WORDS)
        v = len(words)
        if v % NUM_CLASSES:
            raise ValueError(f"{v} words do not split into {NUM_CLASSES} equal classes")
        rng = random.Random(seed)
        order = list(range(v))
        rng.shuffle(order)
        size = v // NUM_CLASSES
        cls = [0] * v
        for rank, w in enumerate(order):
            cls[w] = rank // size
        # the chain's choice: per class h, a bijection {(g, b): class(b) = h} -> words
        top = [[0] * v for _ in range(NUM_CLASSES)]
        for h in range(NUM_CLASSES):
            pairs = [(g, b) for b in range(v) if cls[b] == h for g in range(NUM_CLASSES)]
            perm = list(range(v))
            rng.shuffle(perm)
            for (g, b), c in zip(pairs, perm, strict=True):
                top[g][b] = c
        succ = torch.zeros(NUM_CLASSES, v, 3, dtype=torch.long)
        prob = torch.zeros(NUM_CLASSES, v, 3)
        for g in range(NUM_CLASSES):
            for b in range(v):
                n = rng.choice((1, 2, 3))
                others = rng.sample([c for c in range(v) if c != top[g][b]], 2)
                row = [top[g][b], *others][:n]
                succ[g, b, :n] = torch.tensor(row)
                prob[g, b, :n] = torch.tensor(SUCCESSOR_PROBS[n])
        self.words, self.seed, self.device = words, seed, torch.device(device)
        self.cls = torch.tensor(cls, device=self.device)
        self.top = torch.tensor(top, device=self.device)  # [classes, V]
        self.succ, self.prob = succ.to(self.device), prob.to(self.device)
        # token ids of " word" (rows 0..V-1) and of "word" at the start of a text (V..2V-1)
        forms = [tokenizer.encode(" " + w).ids for w in words]
        forms += [tokenizer.encode(w).ids for w in words]
        if max(len(f) for f in forms) > MAX_WORD_TOKENS:
            raise ValueError("a word spans more than MAX_WORD_TOKENS tokens")
        self.tok = torch.zeros(2 * v, MAX_WORD_TOKENS, dtype=torch.long)
        for i, f in enumerate(forms):
            self.tok[i, : len(f)] = torch.tensor(f)
        self.tok = self.tok.to(self.device)
        self.tok_len = torch.tensor([len(f) for f in forms], device=self.device)
        self.word_index = {w: i for i, w in enumerate(words)}

    @property
    def vocab(self) -> int:
        return len(self.words)

    def entropy_per_word(self) -> float:
        """Mean entropy (nats) of the next word over the (class, word) states."""
        p = self.prob.clamp(min=1e-12)
        return float(-(self.prob * p.log()).sum(-1).mean())

    def sample_words(self, batch: int, length: int, gen: torch.Generator) -> tuple:
        """(words [batch, length], prefix lengths [batch]): uniform random words up to the
        prefix length (2-48), the chain sampled after it."""
        dev = self.device
        words = torch.randint(0, self.vocab, (batch, length), generator=gen, device=dev)
        plen = torch.randint(2, 49, (batch,), generator=gen, device=dev)
        for i in range(2, length):
            g, b = self.cls[words[:, i - 2]], words[:, i - 1]
            pick = torch.multinomial(self.prob[g, b], 1, generator=gen)[:, 0]
            nxt = self.succ[g, b].gather(1, pick[:, None])[:, 0]
            words[:, i] = torch.where(i >= plen, nxt, words[:, i])
        return words, plen

    def greedy_words(self, a: int, b: int, n: int) -> list[int]:
        """The chain's choice ``n`` times after the pair (a, b)."""
        out = []
        for _ in range(n):
            a, b = b, int(self.top[self.cls[a], b])
            out.append(b)
        return out

    def tokens(self, words: torch.Tensor, plen: torch.Tensor, length: int) -> tuple:
        """Token ids [B, length] of word rows (the first word in its start-of-text form) and a
        bool [B, length] marking tokens of chain words (word index >= prefix length)."""
        b, nw = words.shape
        form = words.clone()
        form[:, 0] += self.vocab
        lens = self.tok_len[form]  # [B, nw]
        start = torch.cumsum(lens, dim=1) - lens
        width = nw * MAX_WORD_TOKENS
        ids = torch.zeros(b, width + 1, dtype=torch.long, device=words.device)
        chain = torch.zeros(b, width + 1, dtype=torch.bool, device=words.device)
        is_chain = torch.arange(nw, device=words.device)[None, :] >= plen[:, None]
        for j in range(MAX_WORD_TOKENS):
            here = lens > j
            pos = torch.where(here, start + j, width)  # absent pieces land in a spare column
            ids.scatter_(1, pos, torch.where(here, self.tok[form, j], 0))
            chain.scatter_(1, pos, here & is_chain)
        if int(lens.sum(1).min()) < length:
            raise ValueError("too few words for the token length")
        return ids[:, :length], chain[:, :length]

    def encode_words(self, text: str) -> list[int]:
        return [self.word_index[w] for w in text.split()]


# ---------------------------------------------------------------- model


def init_weights(config: dict, seed: int, device) -> dict[str, torch.Tensor]:
    """Seeded init under HF Llama names: N(0, 0.02), output projections scaled down."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv = config["num_key_value_heads"] * hd
    out_std = 0.02 / math.sqrt(2 * layers)
    shapes = {"model.embed_tokens.weight": ((v, h), 0.02), "lm_head.weight": ((v, h), 0.02)}
    shapes["model.norm.weight"] = ((h,), None)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": ((h,), None),
            p + "post_attention_layernorm.weight": ((h,), None),
            p + "self_attn.q_proj.weight": ((heads * hd, h), 0.02),
            p + "self_attn.k_proj.weight": ((kv, h), 0.02),
            p + "self_attn.v_proj.weight": ((kv, h), 0.02),
            p + "self_attn.o_proj.weight": ((h, heads * hd), out_std),
            p + "mlp.gate_proj.weight": ((inter, h), 0.02),
            p + "mlp.up_proj.weight": ((inter, h), 0.02),
            p + "mlp.down_proj.weight": ((h, inter), out_std),
        }
    w = {}
    for name, (shape, std) in shapes.items():
        t = torch.ones(shape) if std is None else torch.randn(shape, generator=gen) * std
        w[name] = t.to(device)
    return w


def init_model(
    config: dict, base: Path, seed: int, device, tokenizer
) -> tuple[TorchTarget, dict[str, torch.Tensor], dict[str, str]]:
    """(model, trainable weights, {weight name: checkpoint name}).

    A llama config starts from :func:`init_weights` (copied into the ``LlamaForCausalLM`` whose
    parameters are the trainable weights); an M3 config from ``base``'s own weights
    (the tiny builder's seeded random checkpoint), its MoE tensors named ``mlp.`` like
    :class:`M3Target` reads them and saved back under the checkpoint's ``block_sparse_moe.``.
    """
    if config.get("model_type") != M3_MODEL_TYPE:
        model = LlamaTarget.from_weights(config, init_weights(config, seed, device), tokenizer)
        model.model.requires_grad_(True)
        return model, model.w, {k: k for k in model.w}
    from safetensors.torch import load_file

    raw = load_file(str(base / "model.safetensors"))
    names = {k.replace(".block_sparse_moe.", ".mlp."): k for k in raw}
    w = {k: raw[src].float().to(device).requires_grad_(True) for k, src in names.items()}
    return M3Target(config, w, tokenizer), w, names


def chain_loss(model: TorchTarget, ids: torch.Tensor, chain: torch.Tensor, amp: bool):
    """Mean next-token cross-entropy over tokens of chain words, and the argmax hits there."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        logits = model.logits(ids[:, :-1])
    logits, labels, mask = logits.float(), ids[:, 1:], chain[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    ce = ce.view(labels.shape)
    hits = (logits.argmax(-1) == labels) & mask
    return (ce * mask).sum() / mask.sum(), hits


@torch.no_grad()
def choice_agreement(model: TorchTarget, chain: WordChain, words, plen, length, amp) -> float:
    """Share of chain words whose first token the model's argmax gives as the chain's choice,
    predicted from the position before the word."""
    ids, is_chain = chain.tokens(words, plen, length)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        pred = model.logits(ids).argmax(-1)
    form = words.clone()
    form[:, 0] += chain.vocab
    lens = chain.tok_len[form]
    start = torch.cumsum(lens, dim=1) - lens  # first token of every word
    prev2, prev1 = words[:, :-2], words[:, 1:-1]
    expect = chain.tok[chain.top[chain.cls[prev2], prev1], 0]  # [B, nw-2]
    st = start[:, 2:]
    nw = torch.arange(2, words.shape[1], device=words.device)[None, :]
    ok = (nw >= plen[:, None]) & (st < length)
    got = pred.gather(1, (st - 1).clamp(min=0, max=length - 1))
    return float(((got == expect) & ok).sum() / ok.sum())


@torch.no_grad()
def greedy_follow(model: TorchTarget, chain: WordChain, prompts: list[str], max_new: int) -> dict:
    """How closely greedy continuations of ``prompts`` follow the chain's choices."""
    toks = model.encode_batch(prompts)
    seqs = model.greedy_sequences(toks, max_new)
    token_hits, exact = 0, 0
    for text, t, s in zip(prompts, toks, seqs, strict=True):
        w = chain.encode_words(text)
        want = []
        for c in chain.greedy_words(w[-2], w[-1], max_new):
            want += chain.tok[c, : int(chain.tok_len[c])].tolist()
        got = s[len(t) :].tolist()
        hits = [a == b for a, b in zip(got, want[:max_new], strict=True)]
        first_miss = hits.index(False) if False in hits else max_new
        token_hits += first_miss
        exact += first_miss == max_new
    return {
        "prompts": len(prompts),
        "max_new": max_new,
        "tokens_before_first_deviation_mean": round(token_hits / len(prompts), 2),
        "exact_share": round(exact / len(prompts), 4),
    }


def save_fp16(model_w: dict, out: Path) -> Path:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.float16).cpu().contiguous() for k, v in model_w.items()}
    path = out / "model.safetensors"
    save_file(dict(sorted(tensors.items())), str(path), metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="checkpoint with config/tokenizer")
    ap.add_argument("--out", required=True, type=Path, help="target checkpoint to write")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0, help="init and data seed")
    ap.add_argument("--chain-seed", type=int, default=2024)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--max-seconds", type=float, default=140.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=160, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--greedy-prompts", type=int, default=256)
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    dev = torch.device(args.device)
    amp = dev.type == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        if (args.base / name).exists() and args.base.resolve() != args.out.resolve():
            shutil.copyfile(args.base / name, args.out / name)
    config = json.loads((args.out / "config.json").read_text())
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    chain = WordChain(args.chain_seed, tokenizer, dev)
    torch.manual_seed(args.seed)
    model, w, names = init_model(config, args.base, args.seed, dev, tokenizer)
    if args.seq_len > getattr(model, "dense_exact_tokens", args.seq_len):
        raise SystemExit(
            f"--seq-len {args.seq_len}: the M3 model trains with dense attention, which equals "
            f"its sparse attention only up to {model.dense_exact_tokens} tokens"
        )
    decay = [p for p in w.values() if p.dim() >= 2]
    keep = [p for p in w.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": keep}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    nw = args.seq_len + 2  # every word is at least one token
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    eval_gen = torch.Generator(device=dev).manual_seed(10_000 + args.seed)
    ev_words, ev_plen = chain.sample_words(512, nw, eval_gen)
    ev_ids, ev_chain = chain.tokens(ev_words, ev_plen, args.seq_len)
    curve, t_train, step, ema = [], time.time(), 0, None
    print(f"[target] chain entropy {chain.entropy_per_word():.4f} nats/word; training on {dev}")
    for step in range(1, args.steps + 1):
        done = min(1.0, max((step - 1) / args.steps, (time.time() - t_train) / args.max_seconds))
        scale = min(1.0, step / args.warmup) if args.warmup else 1.0
        for g in opt.param_groups:
            g["lr"] = args.lr * scale * 0.5 * (1 + math.cos(math.pi * done))
        words, plen = chain.sample_words(args.batch, nw, gen)
        ids, is_chain = chain.tokens(words, plen, args.seq_len)
        loss, _ = chain_loss(model, ids, is_chain, amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(w.values(), 1.0)
        opt.step()
        if step % 50 == 0 or step == 1:
            ema = loss.item() if ema is None else 0.7 * ema + 0.3 * loss.item()
        if step % args.eval_every == 0 or step == 1:
            with torch.no_grad():
                ev_loss, hits = chain_loss(model, ev_ids, ev_chain, amp)
            acc = float(hits.sum() / ev_chain[:, 1:].sum())
            agree = choice_agreement(model, chain, ev_words, ev_plen, args.seq_len, amp)
            row = {
                "step": step,
                "seconds": round(time.time() - t_train, 1),
                "train_loss": round(ema, 4),
                "held_out_loss": round(ev_loss.item(), 4),
                "held_out_token_acc": round(acc, 4),
                "chain_choice_agreement": round(agree, 4),
            }
            curve.append(row)
            print(f"[target] {row}", flush=True)
        if time.time() - t_train > args.max_seconds:
            print(f"[target] wall-time cap reached at step {step}")
            break
    train_seconds = time.time() - t_train
    with torch.no_grad():
        ev_loss, hits = chain_loss(model, ev_ids, ev_chain, amp)
    agree = choice_agreement(model, chain, ev_words, ev_plen, args.seq_len, amp)
    save_fp16({names[k]: v for k, v in w.items()}, args.out)
    # the saved float16 weights, read back in float32 as distillation and the tests read them
    saved = load_target_model(args.out, dev)
    from .distill import held_out_word_prompts

    follow = greedy_follow(saved, chain, held_out_word_prompts(args.greedy_prompts), 48)
    info = {
        "command": "PYTHONPATH=tools python -m dspark_training.train_target " + shlex.join(argv),
        "seed": args.seed,
        "chain_seed": args.chain_seed,
        "chain": {
            "words": chain.vocab,
            "classes": NUM_CLASSES,
            "successor_probs": {str(k): v for k, v in SUCCESSOR_PROBS.items()},
            "entropy_nats_per_word": round(chain.entropy_per_word(), 4),
            "prefix_words": [2, 48],
        },
        "base": str(args.base),
        "model_type": config.get("model_type"),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "bf16_autocast": amp,
        "steps_run": step,
        "train_seconds": round(train_seconds, 1),
        "tokens_seen": step * args.batch * args.seq_len,
        "final_train_loss": round(ema, 4),
        "held_out_loss_per_chain_token": round(ev_loss.item(), 4),
        "held_out_token_acc": round(float(hits.sum() / ev_chain[:, 1:].sum()), 4),
        "chain_choice_agreement": round(agree, 4),
        "greedy_follows_chain_held_out_words": follow,
        "saved_dtype": "float16",
        "curve": curve,
        "wall_seconds": round(time.time() - t0, 1),
    }
    (args.out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "curve"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
