"""kv_transfer pack/unpack on the GPU at serving sizes: bit-exact against the torch reference.
Run on the GPU machine: `python -m pytest -q tests/gpu/test_kv_transfer.py`."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

UNIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit", "kernels")
sys.path.insert(0, UNIT)


def _unit_module(name: str):
    """The CPU test module of the same family, under another name (the file names collide)."""
    spec = importlib.util.spec_from_file_location(f"unit_{name}", os.path.join(UNIT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_u = _unit_module("test_kv_transfer")
LAYOUTS, UNITS, check_merge, check_pack_unpack, check_split, check_whole_copy = (
    _u.LAYOUTS,
    _u.UNITS,
    _u.check_merge,
    _u.check_pack_unpack,
    _u.check_split,
    _u.check_whole_copy,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("unit_case", UNITS, ids=[u[0] for u in UNITS])
@pytest.mark.parametrize("layout_case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_gpu_pack_unpack(layout_case, unit_case):
    check_pack_unpack(
        layout_case, unit_case, heads=8, head_start=3, head_count=3, num_pages=301, n=97, dev="cuda"
    )


@pytest.mark.parametrize("consumer", [2, 4])
@pytest.mark.parametrize("layout_case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_gpu_split_and_merge(layout_case, consumer):
    check_split(layout_case, torch.bfloat16, (128,), 8, consumer, "cuda", num_pages=64, n=40)
    check_split(layout_case, torch.float8_e4m3fn, (128,), 8, consumer, "cuda", num_pages=64, n=40)
    check_split(layout_case, torch.float32, (), 8, consumer, "cuda", num_pages=64, n=40)
    check_merge(layout_case, torch.bfloat16, (128,), consumer, 8, "cuda", num_pages=64, n=40)


@pytest.mark.parametrize("page_size", [1, 16, 128], ids=lambda p: f"p{p}")
def test_gpu_whole_copy(page_size):
    check_whole_copy(torch.float8_e4m3fn, 128, page_size, "cuda", num_pages=257, n=100)


@pytest.mark.parametrize("align", [1, 8], ids=lambda a: f"align{a}")
def test_gpu_copy_spans(align):
    # on CUDA the long span is several programs' pieces
    _u.test_copy_spans_matches_reference(align)
