"""The demo: a real SGLang server with sgl_atom, driven by the OpenAI client and an SGLang
frontend-language program.

    python -m sgl_atom.demo [--model-path DIR] [--max-new-tokens N]

Builds the tiny checkpoint if needed, launches ``sglang.launch_server`` with the extension (CPU
reference mode on a host without an NVIDIA driver), prints outputs and timings, and shuts the
server down.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .cpu_mode import cache_dir, cpu_mode_enabled
from .testing import DSPARK_CHAIN, tiny
from .testing.server import Server

PROMPTS = ["The capital of france is", "One two three four", "Hello world, the"]


def _openai_section(srv: Server, max_tokens: int) -> None:
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    for prompt in PROMPTS:
        t0 = time.time()
        out = client.completions.create(
            model="default", prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        dt = time.time() - t0
        toks = out.usage.completion_tokens
        print(f"  [openai] {prompt!r} -> {out.choices[0].text!r}  ({toks} tok, {dt:.2f}s)")
    t0 = time.time()
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of france?"}],
        max_tokens=max_tokens,
        temperature=0,
    )
    print(f"  [openai chat] -> {chat.choices[0].message.content!r}  ({time.time() - t0:.2f}s)")


def _frontend_section(srv: Server, max_tokens: int) -> None:
    import sglang as sgl

    @sgl.function
    def qa(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=max_tokens, temperature=0)

    sgl.set_default_backend(sgl.RuntimeEndpoint(srv.url))
    t0 = time.time()
    states = qa.run_batch([{"question": p} for p in PROMPTS[:2]])
    dt = time.time() - t0
    for p, st in zip(PROMPTS[:2], states, strict=True):
        print(f"  [sgl.function] {p!r} -> {st['answer']!r}")
    print(f"  [sgl.function] batch of {len(states)} in {dt:.2f}s")


def _speculation_section(srv: Server, max_tokens: int) -> None:
    outs = srv.generate(PROMPTS, max_new_tokens=max_tokens)
    tokens = sum(len(o["output_ids"]) for o in outs)
    verifies = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    for p, o in zip(PROMPTS, outs, strict=True):
        m = o["meta_info"]
        print(
            f"  [ATOM_DSPARK] {p!r} -> {o['text']!r} (accept length "
            f"{m.get('spec_accept_length', 0):.2f})"
        )
    print(
        f"  [ATOM_DSPARK] tokens/forward {tokens / max(verifies, 1):.2f} "
        f"({tokens} tokens from {verifies} target forwards)"
    )


DSPARK_ARGS = [
    "--dtype",
    "bfloat16",
    "--attention-backend",
    "atom",
    "--speculative-algorithm",
    "ATOM_DSPARK",
    "--speculative-draft-model-path",
    str(DSPARK_CHAIN),
    "--spec-decode-kv-cache-dtype",
    "fp8",
]
# on CPU the atom backend runs its kernels' torch references here (the interpreter is slow)
DSPARK_ENV = {
    "SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models",
    "SGL_ATOM_CPU_KERNELS": "reference",
}

# mode -> (launch args, env, tiny target kind: None for --model-path / the tiny llama)
MODES: dict[str, tuple[list[str], dict[str, str], str | None]] = {
    "plain": ([], {}, None),
    "atom-fp8": (
        [
            "--dtype",
            "bfloat16",
            "--attention-backend",
            "atom",
            "--kv-cache-dtype",
            "fp8_e4m3",
            "--page-size",
            "16",
        ],
        {},
        None,
    ),
    # the draft was distilled against the llama-chain target, so this mode serves that one
    "dspark": (DSPARK_ARGS, DSPARK_ENV, "llama-chain"),
}
LOG_MARKS = (
    "atom attention:",
    "fp8 KV scales",
    "draft KV dtype:",
    "draft KV pool at",
    "ATOM_DSPARK draft",
    "DSpark k=",
)


def run_mode(model: Path, mode: str, extra: list[str], max_new: int) -> None:
    mode_args, env, kind = MODES[mode]
    if kind is not None:
        model = tiny.build(cache_dir() / "tiny" / kind, kind)
    args = ["--max-total-tokens", "4096", *mode_args, *extra]
    print(f"== [{mode}] launch_server {' '.join(mode_args) or '(SGLang defaults)'}")
    t0 = time.time()
    with Server(model, args, env=env, name=f"demo-{mode}") as srv:
        print(f"== [{mode}] server up at {srv.url} in {time.time() - t0:.1f}s")
        print(f"== [{mode}] OpenAI client (/v1/completions, /v1/chat/completions)")
        _openai_section(srv, max_new)
        print(f"== [{mode}] SGLang frontend language (sgl.function + sgl.gen)")
        _frontend_section(srv, max_new)
        if mode == "dspark":
            print(f"== [{mode}] speculative decoding, greedy /generate")
            _speculation_section(srv, max(max_new, 32))
        lines = [ln.strip() for ln in srv.log_text().splitlines()]
        stats = [ln for ln in lines if "DSpark k=" in ln][-1:]  # the latest acceptance line
        for line in lines:
            if any(mark in line for mark in LOG_MARKS[:-1]) or line in stats:
                print(f"   server log: {line}")
    print(f"== [{mode}] server stopped ({time.time() - t0:.1f}s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="sgl_atom demo")
    ap.add_argument("--model-path", type=Path, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument(
        "--mode",
        action="append",
        choices=sorted(MODES),
        help="server configuration(s) to run (default: all, in turn)",
    )
    ap.add_argument("--server-arg", action="append", default=[], help="extra launch_server arg")
    args = ap.parse_args(argv)
    model = args.model_path or tiny.build(cache_dir() / "tiny" / "llama", "llama")
    where = "CPU reference mode" if cpu_mode_enabled() else "GPU"
    print(f"== sgl_atom demo: {model} ({where})")
    extra = [a for arg in args.server_arg for a in arg.split()]
    t0 = time.time()
    for mode in args.mode or list(MODES):
        run_mode(model, mode, extra, args.max_new_tokens)
    print(f"== demo done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
