"""Environment variables: declared once in sgl_atom.envs, all listed in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sgl_atom import envs

ROOT = Path(__file__).resolve().parents[2]


def test_every_variable_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for var in envs.ALL:
        assert f"`{var.name}`" in readme, f"{var.name} missing from the README's table"


# a read of an SGL_ATOM_ variable through os.environ (get, [], setdefault, pop) or os.getenv
DIRECT_READ = re.compile(
    r"""(?:environ(?:\.(?:get|setdefault|pop))?\s*[\[(]|getenv\s*\()\s*[\"']SGL_ATOM_"""
)


@pytest.mark.parametrize(
    "line",
    [
        'os.environ.get("SGL_ATOM_X")',
        "os.environ['SGL_ATOM_X']",
        'os.getenv("SGL_ATOM_X", "1")',
        'getenv( "SGL_ATOM_X")',
        'environ.setdefault("SGL_ATOM_X", "0")',
        'os.environ.pop("SGL_ATOM_X")',
    ],
)
def test_direct_read_pattern_catches(line):
    assert DIRECT_READ.search(line)


def test_no_sgl_atom_variable_is_read_outside_envs():
    for folder in ("sgl_atom", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "envs.py":
                continue
            hit = DIRECT_READ.search(path.read_text())
            assert hit is None, f"{path} reads an SGL_ATOM_ variable directly: {hit.group(0)!r}"


def test_declared_names_are_prefixed_and_unique():
    names = [v.name for v in envs.ALL]
    assert len(names) == len(set(names)) and all(n.startswith("SGL_ATOM_") for n in names)


def test_integer_variable_is_checked(monkeypatch):
    monkeypatch.setenv("SGL_ATOM_SERVER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGL_ATOM_SERVER_TIMEOUT='soon' is not an integer"):
        envs.SGL_ATOM_SERVER_TIMEOUT.get()


def test_sglang_spelling_is_read(monkeypatch):
    """SGLang warns "SGL_ATOM_X is deprecated, please use SGLANG_ATOM_X": that spelling works."""
    var = envs.SGL_ATOM_SERVER_TIMEOUT
    monkeypatch.delenv(var.name, raising=False)
    monkeypatch.delenv(var.sglang_name, raising=False)
    assert var.sglang_name == "SGLANG_ATOM_SERVER_TIMEOUT"
    assert var.get() == var.default and not var.is_set()
    monkeypatch.setenv(var.sglang_name, "17")
    assert var.get() == 17 and var.is_set()
    monkeypatch.setenv(var.name, "17")  # SGLang's copy: both set, the same value
    assert var.get() == 17


def test_own_spelling_wins(monkeypatch):
    """A parent process that imported SGLang holds a copy under SGLANG_ATOM_X; a child given a
    new SGL_ATOM_X reads the new value."""
    var = envs.SGL_ATOM_LOG_LEVEL
    monkeypatch.setenv(var.sglang_name, "info")
    monkeypatch.setenv(var.name, "debug")
    assert var.get() == "debug"
