"""The ATOM_DSPARK speculative worker in a real server: lossless, drafting that means something,
and the draft KV pool at bf16 and fp8 under a bf16 target.

All servers use the atom backend (SGLang's torch_native backend has no target-verify path) with
its kernels' torch references (``SGL_ATOM_CPU_KERNELS=reference``: the worker is under test
here; the interpreted kernels are covered in test_atom_serving), and a small chunked-prefill
size, so long prompts reach the draft in several chunks.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from e2e_utils import side_by_side, word_prompts

from sgl_atom import envs
from sgl_atom.cpu_mode import cache_dir
from sgl_atom.speculative.dspark.algorithm import NAME
from sgl_atom.testing import DSPARK_CHAIN, tiny
from sgl_atom.testing.server import Server

PROMPTS = word_prompts(16, seed=7, min_words=4, max_words=24)
MAX_NEW = 48
ATOM = ["--dtype", "bfloat16", "--attention-backend", "atom", "--chunked-prefill-size", "32"]
SPEC = ["--speculative-algorithm", NAME, "--speculative-draft-model-path", str(DSPARK_CHAIN)]
FAST = {"SGL_ATOM_CPU_KERNELS": "reference"}
MODELS_ENV = {**FAST, "SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_atom.models"}
# bf16 through SGLang's own flag, fp8 through the ATOM spelling
DTYPE_FLAGS = {
    "bf16": ["--speculative-draft-kv-cache-dtype", "bf16"],
    "fp8": ["--spec-decode-kv-cache-dtype", "fp8"],
}
POOL_LINE = re.compile(r"ATOM_DSPARK draft KV pool: (\w+) \(\S+\), (\d+) slots .*?, (\d+) B/token")
# SGLang's KV budget with the draft pool priced in (sgl_atom.patches.pool_budget)
BUDGET_LINE = re.compile(
    r"draft KV pool at (\w+) \(target (\w+)\): (\d+) B/token, .*?\(at \w+: (\d+) B/token.*?"
    r"KV capacity (\d+) tokens vs (\d+) budgeted at the target's dtype \(([+-]\d+)\)"
    r"(?:; --max-total-tokens caps the pool at (\d+) tokens)?"
)


def _run(srv) -> tuple[list[list[int]], list[float]]:
    outs = srv.generate(PROMPTS, max_new_tokens=MAX_NEW)
    ids = [o["output_ids"] for o in outs]
    verify = [o["meta_info"].get("spec_verify_ct", 0) for o in outs]
    tpf = [len(i) / v if v else 0.0 for i, v in zip(ids, verify, strict=True)]
    return ids, tpf


# a grammar the chain never follows by itself: every accepted token must pass its mask
REGEX = "[0-9]{20}"


def _regex_run(srv) -> list[str]:
    """Greedy outputs of two prompts under REGEX (SGLang's grammar backend); a failed request
    is returned as its error, for the grammar test alone to report."""
    params = {"max_new_tokens": 20, "temperature": 0.0, "regex": REGEX}
    try:
        outs = srv.post("/generate", {"text": PROMPTS[:2], "sampling_params": params})
    except requests.HTTPError as e:
        return [f"request failed: {e}"]
    return [o["text"] for o in outs]


@pytest.fixture(scope="module")
def chain_target():
    """The tiny llama trained on a word chain, with the draft distilled against it."""
    return tiny.build(cache_dir() / "tiny" / "llama-chain", "llama-chain")


# "fp8-tp2": the target at TP2 (its embedding and LM head gathered for the draft, which runs
# whole on both ranks and proposes the same tokens on each); "bf16-fp8w": the bf16 pool with the
# draft's GEMMs in fp8 (--speculative-draft-model-quantization fp8)
SPEC_LABELS = ["bf16", "fp8", "fp8-tp2", "bf16-fp8w"]
FP8_WEIGHTS = ["--speculative-draft-model-quantization", "fp8"]
# under SGLang's overlap scheduling (its default) but for these, which run synchronously: the
# same greedy outputs both ways
SYNC_LABELS = {"fp8-tp2"}
OVERLAP_LINE = re.compile(r"ATOM_DSPARK: overlap scheduling (on|off)")


def _spec_args(label: str) -> list[str]:
    dtype, *parts = label.split("-")
    tp = next((p[2:] for p in parts if p.startswith("tp")), "1")
    sync = ["--disable-overlap-schedule"] if label in SYNC_LABELS else []
    quant = FP8_WEIGHTS if "fp8w" in parts else []
    return [*ATOM, *SPEC, *DTYPE_FLAGS[dtype], "--enable-metrics", "--tp", tp, *sync, *quant]


def _spec_run(label: str, srv: Server) -> tuple:
    """(label, greedy ids, tokens/forward per prompt, {"log", "metrics", "tpf_again"})."""
    before = _metrics(srv)
    ids, tpf = _run(srv)
    after = _metrics(srv)
    _flush_cache(srv)  # a second run of the same prompts that re-drafts every token
    again, tpf_again = _run(srv)
    regex = _regex_run(srv) if label == "bf16" else None
    srv.stop()
    assert again == ids, "greedy output is the same in a second run"
    return (
        label,
        ids,
        tpf,
        {"log": srv.log_text(), "metrics": (before, after), "tpf_again": tpf_again,
         "regex": regex},
    )  # fmt: skip


def _plain_run(label: str, srv: Server) -> tuple:
    ids, tpf = _run(srv)
    regex = _regex_run(srv) if label == "plain" else None
    srv.stop()
    return ids, tpf, srv.log_text(), regex


@pytest.fixture(scope="module")
def runs(servers, chain_target) -> dict[str, tuple]:
    """Every serving server of this module, started and answering side by side: "plain" (no
    speculation) and "stale" (the draft when decoded tokens' context K/V is never written) ->
    (greedy ids, tokens/forward, log); each of SPEC_LABELS -> :func:`_spec_run`'s tuple."""
    stale_env = {**MODELS_ENV, "SGL_ATOM_DSPARK_FAULT": "stale-context"}
    jobs = {
        "plain": (_plain_run, ATOM, FAST),
        **{label: (_spec_run, _spec_args(label), MODELS_ENV) for label in SPEC_LABELS},
        "stale": (_plain_run, [*ATOM, *SPEC], stale_env),
    }
    # seven scheduler ranks start at once on two cores: allow them twice the time
    started = servers.start_many(
        {f"dspark-{name}": (chain_target, args, env) for name, (_, args, env) in jobs.items()},
        timeout=2 * envs.SGL_ATOM_SERVER_TIMEOUT.get(),
    )
    return side_by_side(
        lambda name, fn: fn(name, started[f"dspark-{name}"]),
        {name: (name, fn) for name, (fn, _, _) in jobs.items()},
    )


@pytest.fixture(scope="module")
def baseline(runs) -> list[list[int]]:
    return runs["plain"][0]


@pytest.fixture(scope="module", params=SPEC_LABELS)
def spec_run(request, runs):
    return runs[request.param]


def _flush_cache(srv) -> None:
    r = requests.post(srv.url + "/flush_cache", timeout=60)
    assert r.status_code == 200, "the radix cache was flushed between the two runs"


def _metrics(srv) -> str:
    return srv.get("/metrics").text


def _tpf(tpf: list[float]) -> float:
    return sum(tpf) / len(tpf)


def test_lossless(spec_run, baseline, report):
    dtype, ids, tpf, out = spec_run
    same = sum(a == b for a, b in zip(ids, baseline, strict=True))
    overlap = OVERLAP_LINE.search(out["log"])
    assert overlap, "the worker logs whether it runs under overlap scheduling"
    assert overlap.group(1) == ("off" if dtype in SYNC_LABELS else "on")
    if dtype not in SYNC_LABELS:  # no host copy of the lengths: the next step does not wait
        assert "overlap scheduling on, each step's lengths kept on the device" in out["log"]
    report(
        f"ATOM_DSPARK draft KV {dtype}, overlap scheduling {overlap.group(1)}: "
        f"{same}/{len(ids)} greedy outputs identical to no "
        f"speculation ({MAX_NEW} tokens each); tokens/forward {_tpf(tpf):.2f} "
        f"(halves {_tpf(tpf[:8]):.2f} / {_tpf(tpf[8:]):.2f})"
    )
    assert ids == baseline


@pytest.mark.parametrize("spec_run", ["bf16"], indirect=True)
def test_grammar_constrains_every_accepted_token(spec_run, runs, report):
    """A regex request: the verify keeps only tokens the grammar allows (its vocabulary mask
    over the window), so the output matches and equals the plain server's constrained one."""
    got, want = spec_run[3]["regex"], runs["plain"][3]
    report(f"ATOM_DSPARK under regex {REGEX!r}: {got}")
    assert all(re.fullmatch(REGEX, text) for text in want), want
    assert got == want


@pytest.mark.parametrize("spec_run", ["fp8", "fp8-tp2", "bf16-fp8w"], indirect=True)
def test_fp8_tokens_per_forward_within_noise_of_bf16(spec_run, runs, report):
    """The same 16 prompts, two runs per server (radix cache flushed between them): with the
    fp8 pool, or the draft's GEMMs in fp8, tokens/forward differs from the bf16 draft's by no
    more than the noise, taken as the larger of the spread between two runs and the spread
    between the two halves of the prompts (greedy decoding on CPU repeats itself, so the
    run-to-run spread alone is about 0)."""
    label = spec_run[0]
    figures = {}
    for name in ("bf16", label):
        _, _, first, out = runs[name]
        second = out["tpf_again"]
        figures[name] = (_tpf(first), _tpf(second), _tpf(first[:8]), _tpf(first[8:]))
    run_spread = max(abs(f[0] - f[1]) for f in figures.values())
    half_spread = max(abs(f[2] - f[3]) for f in figures.values())
    gap = abs(figures[label][0] - figures["bf16"][0])
    noise = max(run_spread, half_spread, 0.05 * figures["bf16"][0])

    def fig(name: str) -> str:
        a, b, h1, h2 = figures[name]
        return f"{name} runs {a:.2f} / {b:.2f}, halves {h1:.2f} / {h2:.2f}"

    report(
        f"ATOM_DSPARK tokens/forward, draft bf16 vs {label} over the same 16 prompts: "
        f"{figures['bf16'][0]:.2f} vs {figures[label][0]:.2f}, gap {gap:.2f} ({fig('bf16')}; "
        f"{fig(label)})"
    )
    assert gap <= noise, (
        f"{label} draft {figures[label][0]:.2f} tokens/forward vs bf16 {figures['bf16'][0]:.2f}: "
        f"a gap of {gap:.2f} is beyond the noise {noise:.2f} (run spread {run_spread:.2f}, "
        f"halves spread {half_spread:.2f})"
    )


def test_acceptance_logged_and_counted(spec_run):
    _, ids, tpf, out = spec_run
    log = out["log"]
    assert all(len(i) == MAX_NEW for i in ids)
    assert "DSpark k=4: steps" in log, "the worker logs acceptance every 32 verify steps"
    assert _tpf(tpf) >= 4.0, "the distilled draft reaches 4 tokens per target forward at k=4"


def test_draft_pool_dtype(spec_run, chain_target, report):
    label, _, _, out = spec_run
    dtype = label.partition("-")[0]
    m = POOL_LINE.search(out["log"])
    assert m, "the worker logs its draft pool"
    settled, _slots, per_token = m.group(1), int(m.group(2)), int(m.group(3))
    assert settled == dtype
    bf16_bytes = 2 * 2 * 2 * 64 * 2  # K+V, 2 layers, 2 KV heads, head_dim 64, 2 bytes
    expected = bf16_bytes if dtype == "bf16" else bf16_bytes // 2 + 2 * 2 * 2 * 4
    report(f"ATOM_DSPARK draft pool {label}: {per_token} B/token (bf16: {bf16_bytes})")
    assert per_token == expected

    # SGLang's budget prices the draft pool at its settled dtype, next to the target's KV
    b = BUDGET_LINE.search(out["log"])
    assert b, "the pool budget logs the draft pool's bytes and the tokens gained"
    assert (b.group(1), b.group(2)) == (dtype, "bf16")
    assert (int(b.group(3)), int(b.group(4))) == (expected, bf16_bytes)
    tokens, upstream, gained = int(b.group(5)), int(b.group(6)), int(b.group(7))
    assert gained == tokens - upstream
    tp = int(label.partition("-tp")[2] or 1)
    with open(f"{chain_target}/config.json") as f:
        cfg = json.load(f)
    target_cell = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] // tp * 64 * 2
    ratio = (target_cell + bf16_bytes) / (target_cell + expected)
    assert tokens / upstream == pytest.approx(ratio, rel=1e-3), (
        "the budget holds as many more tokens as the draft's bytes per token shrink"
    )
    assert (gained > 0) == (dtype == "fp8")
    assert b.group(8) == "4096", "the line names the --max-total-tokens cap the tests set"
    report(
        f"ATOM_DSPARK {label} KV budget: {tokens} tokens vs {upstream} with the draft at the "
        f"target's dtype ({gained:+d}, x{tokens / upstream:.3f})"
    )


@pytest.mark.parametrize("spec_run", ["bf16-fp8w"], indirect=True)
def test_fp8_draft_weights_logged(spec_run, runs, report):
    """--speculative-draft-model-quantization fp8: the draft's GEMM layers, its Markov head's w2
    and its copy of the target's LM head in fp8, said at start-up; the drafts change a little,
    the outputs not at all (test_lossless), and a server without the flag keeps a bf16 draft."""
    log = spec_run[3]["log"]
    weights = re.search(r"ATOM_DSPARK draft .*?fp8 GEMM weights \(([0-9.]+) MiB with", log)
    head = re.search(r"draft LM head: an fp8 copy of the target's \(([0-9.]+) MiB\)", log)
    assert weights and head, "the worker logs the draft's fp8 weights and LM head"
    # the chain draft's fc, 2 x (q/k/v, o, gate/up, down) and a 512 x 256 head: a byte per
    # weight and a 4-byte scale per row
    assert float(head.group(1)) == pytest.approx((512 * 256 + 512 * 4) / 2**20, abs=0.05)
    report(f"ATOM_DSPARK fp8 draft weights: {weights.group(1)} MiB, LM head {head.group(1)} MiB")
    assert "fp8 GEMM weights" not in runs["bf16"][3]["log"]


@pytest.fixture(scope="module")
def stale_run(runs) -> tuple:
    return runs["stale"]


def test_broken_context_write_collapses_acceptance(stale_run, spec_run, baseline, report):
    ids, tpf, log, _ = stale_run
    _, _, good_tpf, _ = spec_run
    assert "stale-context: decoded tokens get no draft context" in log
    good, bad = _tpf(good_tpf) - 1, _tpf(tpf) - 1  # accepted drafts per verify
    report(
        f"ATOM_DSPARK without the decode-time context write: tokens/forward {_tpf(tpf):.2f} "
        f"vs {_tpf(good_tpf):.2f}"
    )
    assert bad < 0.5 * good, "a broken context path must show in acceptance"
    assert ids == baseline, "verification keeps the output exact even with a bad draft"


def _counter(text: str, name: str) -> float:
    rows = re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
    assert rows, f"{name} is exported"
    return sum(float(v) for v in rows)


def test_metrics_report_tokens_per_forward(spec_run, report):
    dtype, ids, tpf, out = spec_run
    before, after = out["metrics"]

    def delta(name: str) -> float:
        return _counter(after, name) - (_counter(before, name) if name in before else 0.0)

    generated = delta("sglang:generation_tokens_total")
    verifies = delta("sglang:spec_verify_calls_total")
    report(
        f"ATOM_DSPARK {dtype} Prometheus: {generated:.0f} generated tokens / {verifies:.0f} "
        f"verify calls = {generated / verifies:.2f} tokens per forward"
    )
    assert generated == sum(len(i) for i in ids)
    assert verifies == pytest.approx(sum(len(i) / t for i, t in zip(ids, tpf, strict=True)))


REFUSED = {  # name: (args, env, what the start-up error names)
    "no-draft": (
        ["--speculative-algorithm", NAME],
        MODELS_ENV,
        "needs --speculative-draft-model-path",
    ),
    "window-mismatch": (
        [*SPEC, "--speculative-num-draft-tokens", "3"],
        MODELS_ENV,
        "does not match the draft's block size k=4",
    ),
    "no-model-package": (SPEC, FAST, "SGLANG_EXTERNAL_MODEL_PACKAGE=sgl_atom.models"),
    "draft-quant-awq": (
        [*SPEC, "--speculative-draft-model-quantization", "awq"],
        MODELS_ENV,
        "--speculative-draft-model-quantization awq: the ATOM_DSPARK draft takes fp8",
    ),
    "torch-native": (
        [*SPEC, "--attention-backend", "torch_native"],
        MODELS_ENV,
        f"--speculative-algorithm {NAME} needs --attention-backend atom",
    ),
    # a YaRN draft whose table (64 original positions x factor 1) the context outgrows
    "rope-too-short": (
        ["--speculative-algorithm", NAME, "--speculative-draft-model-path", "{yarn_draft}"],
        MODELS_ENV,
        "(yarn scaling) covers 64 positions, the server needs",
    ),
}


@pytest.fixture(scope="module")
def yarn_draft(tmp_path_factory):
    """The chain draft (its weights linked) under a YaRN scaling that fixes its RoPE table at
    64 positions."""
    path = tmp_path_factory.mktemp("yarn-draft")
    raw = json.loads((DSPARK_CHAIN / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 64}
    raw["rope_scaling"] = yarn
    (path / "config.json").write_text(json.dumps(raw))
    for f in DSPARK_CHAIN.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f.resolve())
    return path


@pytest.fixture(scope="module")
def refused(servers, chain_target, yarn_draft) -> dict[str, Server]:
    """The servers of REFUSED, started side by side; each must refuse start-up."""
    jobs = {
        name: (
            chain_target,
            ["--attention-backend", "atom", *(a.format(yarn_draft=yarn_draft) for a in args)],
            env,
        )
        for name, (args, env, _) in REFUSED.items()
    }
    return servers.start_many(jobs, timeout=240, refused=jobs)


@pytest.mark.parametrize("name", REFUSED)
def test_refused_at_startup(refused, name):
    assert REFUSED[name][2] in refused[name].start_error
