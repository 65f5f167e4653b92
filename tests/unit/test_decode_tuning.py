"""Decode tuning files: what the atom backend reads to pick its decode kernel variant."""

from __future__ import annotations

import json

import pytest
import torch

from sgl_atom.attention import decode_tuning as dt


def _write(tmp_path, decode) -> str:
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"device": "X", "decode": decode}))
    return str(path)


def test_file_overrides_defaults_per_kv(tmp_path):
    fp8 = {"kv_mode": "bits", "block_n": 256, "num_warps": 8, "num_stages": 5, "waves": 4.0}
    fp8["maxnreg"] = 128
    path = _write(tmp_path, {"bf16": {"block_n": 64}, "fp8": fp8})
    tuning, source = dt.load("fp8", "any device", path)
    assert source == path
    assert tuning.waves == 4.0
    assert tuning.kernel_kwargs() == {k: v for k, v in fp8.items() if k != "waves"}
    bf16, _ = dt.load("bf16", "any device", path)
    assert bf16.kernel_kwargs() == {"block_n": 64} and bf16.waves == 2.0


def test_no_file_for_the_device_means_launcher_defaults():
    tuning, source = dt.load("bf16", "A device with no tuning file 9000")
    assert tuning == dt.DecodeTuning() and tuning.kernel_kwargs() == {}
    assert source == "built-in defaults"


def test_device_file_name():
    assert dt.device_file("NVIDIA H200").name == "NVIDIA_H200.json"
    assert dt.device_file("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"


@pytest.mark.parametrize(
    "entry,words",
    [
        ({"block_n": 96}, "block_n=96"),
        ({"kv_mode": "int4"}, "kv_mode='int4'"),
        ({"waves": 0}, "waves=0"),
        ({"maxnreg": 16}, "maxnreg=16"),
        ({"maxnreg": 128.0}, "maxnreg=128.0"),
        ({"num_warp": 4}, "unknown field(s) ['num_warp']"),
        ([128], "expected an object"),
    ],
    ids=["block_n", "kv_mode", "waves", "maxnreg-low", "maxnreg-float", "typo", "not-object"],
)
def test_bad_entries_are_refused_by_name(tmp_path, entry, words):
    path = _write(tmp_path, {"fp8": entry})
    with pytest.raises(dt.DecodeTuningError, match="decode.fp8") as e:
        dt.load("fp8", "X", path)
    assert words in str(e.value)


def test_missing_kind_missing_file_and_bad_json(tmp_path):
    path = _write(tmp_path, {"bf16": {}})
    with pytest.raises(dt.DecodeTuningError, match="no 'decode' entry for 'fp8'"):
        dt.load("fp8", "X", path)
    with pytest.raises(dt.DecodeTuningError, match="no such file"):
        dt.load("fp8", "X", str(tmp_path / "absent.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(dt.DecodeTuningError, match="not JSON"):
        dt.load("fp8", "X", str(tmp_path / "bad.json"))


def test_committed_files_parse():
    """Every committed device file loads for both KV kinds."""
    for file in sorted(dt.TUNED_DIR.glob("*.json")):
        for kv in dt.KV_KINDS:
            for section in dt.SECTIONS:
                device = json.loads(file.read_text())["device"]
                tuning, source = dt.load(kv, device, section=section)
                assert str(file) in source and isinstance(tuning, dt.DecodeTuning)


def test_kv_mode_the_model_cannot_take_is_refused_at_start_up():
    bits = dt.DecodeTuning(kv_mode="bits")
    dt.check_kv_mode(bits, torch.bfloat16, "f.json")  # bf16 model: fine
    with pytest.raises(dt.DecodeTuningError, match="f.json: kv_mode 'bits' needs a bf16 q"):
        dt.check_kv_mode(bits, torch.float16, "f.json")
    dt.check_kv_mode(dt.DecodeTuning(), torch.float16, "f.json")  # no mode: the default


def test_verify_section_is_optional_and_checked(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"decode": {"bf16": {}}}))
    tuning, source = dt.load("bf16", "X", str(path), "verify")
    assert tuning == dt.DecodeTuning() and "no verify entry" in source
    verify = {"bf16": {"block_n": 128, "num_stages": 3}, "fp8": {"waves": 4.0}}
    path.write_text(json.dumps({"decode": {"bf16": {"block_n": 64}}, "verify": verify}))
    tuning, source = dt.load("bf16", "X", str(path), "verify")
    assert source == str(path) and tuning.kernel_kwargs() == {"block_n": 128, "num_stages": 3}
    assert dt.load("bf16", "X", str(path))[0].kernel_kwargs() == {"block_n": 64}
    assert dt.load("fp8", "X", str(path), "verify")[0].waves == 4.0
    path.write_text(json.dumps({"decode": {}, "verify": {"bf16": {"block_n": 100}}}))
    with pytest.raises(dt.DecodeTuningError, match=r"verify\.bf16.*block_n=100"):
        dt.load("bf16", "X", str(path), "verify")
    with pytest.raises(dt.DecodeTuningError, match="no 'verify' entry for 'fp8'"):
        dt.load("fp8", "X", str(path), "verify")
    with pytest.raises(ValueError, match="section 'prefill'"):
        dt.load("bf16", "X", str(path), "prefill")


def test_committed_h200_verify_tiling():
    """The committed H200 file tunes bf16 and fp8 verify (benchmarks/results/tune_verify.log),
    register cap and fp8 KV mode included, apart from the decode entries."""
    tuning, source = dt.load("bf16", "NVIDIA H200", section="verify")
    assert source.endswith("NVIDIA_H200.json")
    assert tuning.kernel_kwargs() == {
        "block_n": 64,
        "num_warps": 4,
        "num_stages": 2,
        "maxnreg": 128,
    }
    fp8, _ = dt.load("fp8", "NVIDIA H200", section="verify")
    assert fp8.kernel_kwargs() == {
        "block_n": 128,
        "num_warps": 4,
        "num_stages": 3,
        "kv_mode": "f16pairs",
    }
    assert dt.load("bf16", "NVIDIA H200")[0].kernel_kwargs()["block_n"] == 64


def test_every_kernel_kv_mode_is_a_valid_entry(tmp_path):
    """A file may name any mode the kernels take (the sweep writes "f16pairs" on the H200)."""
    from sgl_atom.kernels.paged_attention.common import KV_MODES

    for mode in KV_MODES:
        tuning, _ = dt.load("fp8", "X", _write(tmp_path, {"fp8": {"kv_mode": mode}}))
        assert tuning.kernel_kwargs() == {"kv_mode": mode}
    with pytest.raises(dt.DecodeTuningError, match="'pairs' needs a bf16 q"):
        dt.check_kv_mode(dt.DecodeTuning(kv_mode="pairs"), torch.float16, "f.json")


def _tuners():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import tune_decode
    import tune_verify

    return tune_decode, tune_verify


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_every_swept_tiling_is_a_tuning_entry_the_backend_takes(fp8):
    """Whatever the sweeps pick, --write-config writes an entry the backend parses."""
    for tuner in _tuners():
        for quick in (False, True):
            for cfg in tuner.variants(fp8, quick):
                tuning = dt.parse(cfg, f"{tuner.__name__} {cfg}")
                assert tuning.waves == cfg["waves"]
                assert tuning.kernel_kwargs() == {k: v for k, v in cfg.items() if k != "waves"}


def test_verify_picks_go_into_the_tuning_file_beside_its_decode_entry(tmp_path):
    """tune_verify --write-config on a device's tuning file: the decode entry stays, so the file
    still serves; the verify entry is replaced; another device's file is refused."""
    _, tune_verify = _tuners()
    path = tmp_path / "t.json"
    decode = {"bf16": {"block_n": 64}, "fp8": {"kv_mode": "f16pairs", "maxnreg": 128}}
    doc = {"device": "X", "decode": decode, "note": "d", "verify": {"bf16": {}}, "verify_note": "v"}
    path.write_text(json.dumps(doc))
    picks = {"bf16": {"block_n": 64, "num_stages": 2, "maxnreg": 128, "waves": 2.0},
             "fp8": {"waves": 2.0}}  # fmt: skip
    tune_verify.write_verify(str(path), picks, "X", ["--write-config", str(path)])
    assert dt.load("fp8", "X", str(path))[0].kernel_kwargs() == decode["fp8"]
    written = json.loads(path.read_text())
    assert written["note"] == "d" and "verify_note" not in written  # the replaced picks' note
    got, _ = dt.load("bf16", "X", str(path), "verify")
    assert got.kernel_kwargs() == {"block_n": 64, "num_stages": 2, "maxnreg": 128}
    with pytest.raises(SystemExit, match="a tuning file of 'X', not 'Y'"):
        tune_verify.write_verify(str(path), picks, "Y", [])
    fresh = tmp_path / "new.json"
    tune_verify.write_verify(str(fresh), picks, "Y", [])
    assert dt.load("bf16", "Y", str(fresh), "verify")[0].maxnreg == 128


def test_decode_picks_keep_the_files_verify_entry(tmp_path):
    """tune_decode --write-config on a file with a verify tiling keeps that tiling."""
    tune_decode, _ = _tuners()
    path = tmp_path / "t.json"
    verify = {"bf16": {"block_n": 128, "num_stages": 3}}
    path.write_text(json.dumps({"device": "X", "decode": {}, "verify": verify}))
    tune_decode.merge_tuning(str(path), "X", {"decode": {"bf16": {"block_n": 32}, "fp8": {}}})
    assert dt.load("bf16", "X", str(path))[0].block_n == 32
    assert dt.load("bf16", "X", str(path), "verify")[0].kernel_kwargs() == verify["bf16"]
