"""Shared constants and helpers of the end-to-end tests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_atom.testing.server import Server

PROMPTS = [
    "The capital of france is",
    "One two three four five",
    "Hello world, the small cat",
    "What is the number 42?",
]
MAX_NEW = 12
# --sleep-on-idle: an idle scheduler waits on its sockets instead of polling a core.
BASE_ARGS = ["--max-total-tokens", "4096", "--max-running-requests", "8", "--sleep-on-idle"]


def greedy_texts(srv: Server, prompts=PROMPTS, max_new=MAX_NEW) -> list[list[int]]:
    return [o["output_ids"] for o in srv.generate(list(prompts), max_new_tokens=max_new)]


def side_by_side(fn, jobs: dict) -> dict:
    """``{name: fn(*args)}`` for ``{name: args}``, every call at once (a thread each: one per
    server, so servers that share the cores answer together)."""
    with ThreadPoolExecutor(max(1, len(jobs))) as ex:
        futs = {name: ex.submit(fn, *args) for name, args in jobs.items()}
        return {name: f.result() for name, f in futs.items()}


def word_prompts(n: int, seed: int = 0, min_words: int = 4, max_words: int = 40) -> list[str]:
    """``n`` deterministic prompts from the tiny tokenizer's vocabulary, of mixed lengths."""
    import random

    from sgl_atom.testing.tiny import _WORDS

    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(n)
    ]


def greedy_from_ids(srv: Server, input_ids: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations of token-id prompts (``ignore_eos``, exactly ``max_new`` tokens)."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
    }
    return [o["output_ids"] for o in srv.post("/generate", payload)]


def teacher_forced_logprobs(srv: Server, sequences: list[list[int]], top: int = 0):
    """Log-prob of every token of each sequence given its prefix (the first token has none).

    With ``top`` > 0 also returns, per sequence and position, the gap between the best and the
    second-best log-prob there (how close the greedy choice was to a tie).
    """
    payload = {
        "input_ids": sequences,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": max(top, 0),
    }
    outs = srv.post("/generate", payload)
    lps = [[lp for lp, _tok, *_ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]
    if not top:
        return lps
    gaps = [
        [None if t is None else t[0][0] - t[1][0] for t in o["meta_info"]["input_top_logprobs"]]
        for o in outs
    ]
    return lps, gaps


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    return same / sum(len(r) for r in a)


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(diffs) / len(diffs)


def divergence_gaps(ref: dict, got: list[list[int]], prompt_ids) -> list[float]:
    """For each sequence whose greedy tokens differ from ``ref``'s, the reference's top-1/top-2
    log-prob gap at the first differing position: how near a tie the choice was there."""
    gaps = []
    for k, (a, b) in enumerate(zip(ref["greedy"], got, strict=False)):
        j = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if j is not None:
            gaps.append(ref["gaps"][k][len(prompt_ids[k]) + j])
    return gaps


def listening_sockets(pgid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in process group ``pgid`` (Linux /proc)."""
    import glob
    import ipaddress
    import os

    inodes = set()
    for d in glob.glob("/proc/[0-9]*"):
        try:
            if os.getpgid(int(d[6:])) != pgid:
                continue
            for fd in glob.glob(f"{d}/fd/*"):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                addr_hex, port_hex = cols[1].split(":")
                raw = bytes.fromhex(addr_hex)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                found.append((str(ipaddress.ip_address(raw)), int(port_hex, 16)))
    return found


def assert_bf16_agreement(ref: dict, got: dict, prompt_ids, label: str) -> str:
    """Hold an atom bf16 server's answers to a reference backend's on the same checkpoint:
    teacher-forced log-probs within 0.1, greedy sequences parting only at the reference's
    near-ties (a random checkpoint has many), most sequences identical. Returns the figures."""
    agree = token_agreement(ref["greedy"], got["greedy"])
    worst = max_abs_diff(ref["logprobs"], got["logprobs"])
    same = sum(a == b for a, b in zip(ref["greedy"], got["greedy"], strict=True))
    gaps = divergence_gaps(ref, got["greedy"], prompt_ids)
    n, new = len(ref["greedy"]), len(ref["greedy"][0]) if ref["greedy"] else 0
    figures = (
        f"{label}: {agree:.1%} identical greedy tokens by position, {same}/{n} sequences "
        f"identical ({n} prompts x {new}); max teacher-forced |dlogprob| {worst:.4f}; reference "
        f"top-2 gap where sequences first differ: max {max(gaps, default=0):.4f}"
    )
    assert "atom attention:" in got["log"]
    assert worst < 0.1, figures
    assert all(g < 2 * worst + 0.02 for g in gaps), (gaps, figures)
    assert agree >= 0.6 and same >= n // 2, figures
    return figures


# ---- measured figures, printed at the end of a run (conftest imports these) -------------

_REPORT: list[str] = []
_FIGURE = "sgl_atom_figure"


@pytest.fixture
def report(request):
    """Record a measured figure; all of them are printed at the end of the run. Kept in the
    test's ``user_properties``, which pytest-xdist carries from its workers to the run's end."""
    return lambda line: request.node.user_properties.append((_FIGURE, str(line)))


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # the test's properties are complete by then
        _REPORT.extend(v for k, v in report.user_properties if k == _FIGURE)


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("sgl_atom measured figures")
        for line in _REPORT:
            terminalreporter.write_line(line)
