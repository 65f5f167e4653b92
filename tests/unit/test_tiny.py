"""The tiny-checkpoint builder: complete, deterministic, skips finished work, atomic."""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sgl_atom.testing import tiny


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "llama"
    logs: list[str] = []
    tiny.build(out, "llama", log=logs.append)
    return out, logs


def test_build_writes_a_complete_checkpoint(built):
    out, logs = built
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()
    assert any("1/3" in line for line in logs) and any("ready" in line for line in logs)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of france is")["input_ids"]
    assert tok.decode(ids) == "The capital of france is"
    assert cfg["vocab_size"] >= len(tok)


def test_rebuild_is_skipped(built):
    out, _ = built
    before = (out / "model.safetensors").stat().st_mtime_ns
    logs: list[str] = []
    tiny.build(out, "llama", log=logs.append)
    assert logs == [f"[tiny] llama checkpoint already built at {out}"]
    assert (out / "model.safetensors").stat().st_mtime_ns == before


def test_same_seed_same_weights(built, tmp_path):
    out, _ = built
    again = tiny.build(tmp_path / "again", "llama", log=lambda _: None)
    assert _digest(again) == _digest(out)


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setitem(tiny.KINDS, "llama", (tiny.KINDS["llama"][0], boom))
    with pytest.raises(KeyboardInterrupt):
        tiny.build(tmp_path / "x", "llama", log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == [".x.lock"]  # the build's lock file only


def test_concurrent_builds_build_once(tmp_path):
    """Two builders of one checkpoint at once (pytest-xdist workers): one builds, the other
    waits on the lock and finds it built; neither sees a half-moved directory."""
    out, barrier = tmp_path / "llama", threading.Barrier(2)
    logs: list[list[str]] = [[], []]

    def one(i: int) -> Path:
        barrier.wait()
        return tiny.build(out, "llama", log=logs[i].append)

    with ThreadPoolExecutor(2) as ex:
        paths = list(ex.map(one, range(2)))
    assert paths == [out.resolve()] * 2
    built = [any("checkpoint ready at" in line for line in lg) for lg in logs]
    skipped = [lg == [f"[tiny] llama checkpoint already built at {out.resolve()}"] for lg in logs]
    assert sorted(built) == [False, True] and sorted(skipped) == [False, True], logs
    assert tiny.is_built(out, "llama")


def test_unknown_kind_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny checkpoint kind 'gpt'.*llama"):
        tiny.build(tmp_path / "x", "gpt")
