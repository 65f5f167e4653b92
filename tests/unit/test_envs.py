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


def test_no_sgl_atom_variable_is_read_outside_envs():
    pattern = re.compile(r"environ(?:\.get)?\(?\[?[\"']SGL_ATOM_")
    for path in (ROOT / "sgl_atom").rglob("*.py"):
        if path.name == "envs.py":
            continue
        assert not pattern.search(path.read_text()), f"{path} reads SGL_ATOM_* directly"


def test_declared_names_are_prefixed_and_unique():
    names = [v.name for v in envs.ALL]
    assert len(names) == len(set(names)) and all(n.startswith("SGL_ATOM_") for n in names)


def test_integer_variable_is_checked(monkeypatch):
    monkeypatch.setenv("SGL_ATOM_SERVER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGL_ATOM_SERVER_TIMEOUT='soon' is not an integer"):
        envs.SGL_ATOM_SERVER_TIMEOUT.get()
