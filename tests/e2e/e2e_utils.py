"""Shared constants and helpers of the end-to-end tests."""

from __future__ import annotations

from sgl_atom.testing.server import Server

PROMPTS = [
    "The capital of france is",
    "One two three four five",
    "Hello world, the small cat",
    "What is the number 42?",
]
MAX_NEW = 12
BASE_ARGS = ["--max-total-tokens", "4096", "--max-running-requests", "8"]


def greedy_texts(srv: Server, prompts=PROMPTS, max_new=MAX_NEW) -> list[list[int]]:
    return [o["output_ids"] for o in srv.generate(list(prompts), max_new_tokens=max_new)]
