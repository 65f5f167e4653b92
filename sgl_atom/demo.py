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
from .testing import tiny
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


MODES = {
    "plain": [],
    "atom-fp8": [
        "--dtype",
        "bfloat16",
        "--attention-backend",
        "atom",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--page-size",
        "16",
    ],
}


def run_mode(model: Path, mode: str, extra: list[str], max_new: int) -> None:
    args = ["--max-total-tokens", "4096", *MODES[mode], *extra]
    print(f"== [{mode}] launch_server {' '.join(MODES[mode]) or '(SGLang defaults)'}")
    t0 = time.time()
    with Server(model, args, name=f"demo-{mode}") as srv:
        print(f"== [{mode}] server up at {srv.url} in {time.time() - t0:.1f}s")
        print(f"== [{mode}] OpenAI client (/v1/completions, /v1/chat/completions)")
        _openai_section(srv, max_new)
        print(f"== [{mode}] SGLang frontend language (sgl.function + sgl.gen)")
        _frontend_section(srv, max_new)
        for line in srv.log_text().splitlines():
            if "atom attention:" in line or "fp8 KV scales" in line:
                print(f"   server log: {line.strip()}")
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
