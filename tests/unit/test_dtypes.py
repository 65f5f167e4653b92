"""The one dtype table (sgl_atom.dtypes) and its two users' vocabularies."""

from __future__ import annotations

import pytest
import torch

from sgl_atom import dtypes
from sgl_atom.disagg.regions import RegionError, canonical_dtype
from sgl_atom.speculative import draft_kv_dtype as dk


@pytest.mark.parametrize("d", dtypes.DTYPES, ids=lambda d: d.short)
def test_each_row_matches_torch(d):
    t = getattr(torch, d.torch_name)
    assert t.itemsize == d.element_bytes
    assert dtypes.short_of_torch(t) == d.short
    for spelling in (d.torch_name, f"torch.{d.torch_name}", d.short, *d.spellings):
        assert dtypes.torch_name(spelling) == d.torch_name
        assert canonical_dtype(spelling) == d.torch_name  # the P/D regions' vocabulary


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "fp8", "fp8_e4m3", " FP8 "])
def test_draft_option_and_regions_agree_on_bf16_and_fp8(spelling):
    short = dk.canonical_draft_dtype(spelling)
    assert short in dk.CHOICES
    assert canonical_dtype(spelling.strip().lower()) == dtypes.torch_name(short)


@pytest.mark.parametrize("spelling", ["fp16", "half", "fp8_e5m2", "float8_e4m3fn", "auto"])
def test_draft_option_refuses_what_the_table_knows_but_is_not_bf16_or_fp8(spelling):
    with pytest.raises(dk.DraftKVDtypeError, match="use bf16 or fp8"):
        dk.canonical_draft_dtype(spelling)


def test_unknown_names():
    assert dtypes.torch_name("fp4_e2m1") is None and dtypes.short_name("float32") is None
    with pytest.raises(RegionError, match="unknown dtype 'fp4_e2m1'; known: bfloat16"):
        canonical_dtype("torch.fp4_e2m1")
    with pytest.raises(KeyError, match="unknown dtype 'auto'"):
        dtypes.element_bytes("auto")
    assert dk.canonical_target("half") == "half" and dk.canonical_target("bfloat16") == "bf16"
