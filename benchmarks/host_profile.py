"""Where a server's scheduler spends its host time while a batch decodes: py-spy samples the
scheduler process (``bench_server.py --host-profile SECONDS``), and this module sums the samples
of its main thread.

With overlap scheduling the host prepares step N + 1 while the GPU runs step N, so a step takes
the longer of the two. The GPU side is what ``--profile-steps`` measures; this is the other
side: the main thread's samples while on a CPU, split into those waiting for the GPU (a leaf
frame of torch's ``Event``/``Stream`` ``synchronize``, where SGLang's overlap scheduler waits
for a step's results; CUDA's default sync spins, so py-spy sees it as running) and the rest,
its own work. A copy to the host made inside C (``.tolist()``, ``.item()``) waits too and shows
as the line that calls it, among the top leaf frames. Own work close to the step time
means the host sets the pace.

py-spy comes from the ``py-spy`` wheel (PyPI); the device machine has no package index, so the
binary travels with the call (``SGL_ATOM_PY_SPY``, else ``py-spy`` on PATH). A probe: it reads
a running server, it changes nothing it runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

# leaf Python frames that wait for the GPU
WAIT_LEAVES = ("synchronize", "wait")
RATE_HZ = 1000


def py_spy() -> str | None:
    """The py-spy binary: ``SGL_ATOM_PY_SPY``, else on PATH, else None."""
    from sgl_atom import envs

    path = envs.SGL_ATOM_PY_SPY.get() or shutil.which("py-spy")
    return path if path and os.access(path, os.X_OK) else None


def scheduler_pid(server_pid: int) -> int | None:
    """The scheduler process under a ``sglang.launch_server`` process: a descendant whose title
    or command line names the scheduler (SGLang sets ``sglang::scheduler...``)."""
    import psutil

    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline()) + " " + child.name()
        except psutil.Error:
            continue
        if "scheduler" in title:
            return child.pid
    return None


def record(pid: int, seconds: int, out: Path) -> tuple[Path, str]:
    """(raw stacks file, py-spy's output) of ``seconds`` of sampling ``pid``'s threads at
    ``RATE_HZ``, idle samples left out, without stopping the process. py-spy says in its
    output when it fell behind that rate."""
    exe = py_spy()
    if exe is None:
        raise FileNotFoundError("py-spy not found: set SGL_ATOM_PY_SPY or put py-spy on PATH")
    cmd = [exe, "record", "-p", str(pid), "-d", str(seconds), "-r", str(RATE_HZ), "-f", "raw",
           "-o", str(out), "--threads", "--nonblocking", "--full-filenames"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    text = done.stdout + done.stderr
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({done.returncode}): {text[-600:]}")
    return out, text


def _frames(stack: str) -> list[str]:
    return [f for f in stack.split(";") if f]


def _short(frame: str) -> str:
    """A frame with its file's path from the package on (``sglang/...``, ``sgl_atom/...``)."""
    return re.sub(r"\((?:[^()]*/)?((?:sglang|sgl_atom|torch|triton|kernels)/[^()]*)\)", r"(\1)",
                  frame)  # fmt: skip


def summarize(raw: Path, seconds: int, step_ms: float, top: int = 12) -> dict:
    """The main thread's share of the window on a CPU (its samples against ``RATE_HZ`` x
    ``seconds``), split into waiting for the GPU and its own work, per decode step of
    ``step_ms``; its top leaf frames and its top frames of sgl_atom and of SGLang's scheduler
    (inclusive), each as ms per step."""
    per_thread: Counter[str] = Counter()
    stacks: list[tuple[str, list[str], int]] = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = _frames(stack)
        thread = frames[0] if frames and frames[0].startswith(("thread", "process")) else "?"
        per_thread[thread] += int(count)
        stacks.append((thread, frames, int(count)))
    if not per_thread:
        return {"error": "no samples"}
    main = per_thread.most_common(1)[0][0]
    total = RATE_HZ * seconds  # samples in the window
    steps = seconds * 1e3 / step_ms if step_ms else 0.0
    leaves: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    sched: Counter[str] = Counter()
    wait = 0
    for thread, frames, n in stacks:
        if thread != main:
            continue
        leaf = frames[-1]
        leaves[leaf] += n
        if any(re.search(rf"\b{w} \(", leaf) for w in WAIT_LEAVES):
            wait += n
        for f in {re.sub(r":\d+\)$", ")", f) for f in frames}:  # per function, not line
            if "sgl_atom/" in f:
                ours[f] += n
            elif "managers/scheduler" in f or "speculative/" in f:
                sched[f] += n
    busy = sum(leaves.values())

    def ms(n: int) -> float:  # n samples' share of the window, as ms of one step
        return n / total * step_ms

    return {
        "main_thread": main,
        "steps": steps,
        "step_ms": step_ms,
        "busy_ms_per_step": ms(busy),
        "wait_ms_per_step": ms(wait),
        "work_ms_per_step": ms(busy - wait),
        "top_leaves": [(f, ms(n)) for f, n in leaves.most_common(top)],
        "top_sgl_atom": [(f, ms(n)) for f, n in ours.most_common(top)],
        "top_scheduler": [(f, ms(n)) for f, n in sched.most_common(top)],
    }


def report(label: str, s: dict) -> str:
    """Markdown of :func:`summarize`."""
    if "error" in s:
        return f"### {label}\n\n{s['error']}\n"
    lines = [
        f"### {label}",
        "",
        f"{s['steps']:.0f} decode steps of {s['step_ms']:.2f} ms sampled ({RATE_HZ} Hz). "
        "Scheduler main thread per step: on a CPU "
        f"{s['busy_ms_per_step']:.2f} ms, of which waiting for the GPU "
        f"{s['wait_ms_per_step']:.2f} ms and its own work **{s['work_ms_per_step']:.2f} ms**.",
        "",
    ]
    for title, key in (("leaf frame (self time)", "top_leaves"),
                       ("sgl_atom frame (inclusive)", "top_sgl_atom"),
                       ("SGLang scheduler / spec frame (inclusive)", "top_scheduler")):  # fmt: skip
        lines += [f"| {title} | ms/step |", "|---|---|"]
        lines += [f"| `{_short(f)[:120]}` | {v:.3f} |" for f, v in s[key]]
        lines.append("")
    return "\n".join(lines)
