"""CPU reference mode: shim build, bad set-ups, the launcher's command and checks."""

from __future__ import annotations

import ctypes
import socket
import subprocess
import sys

import pytest

from sgl_atom import cpu_mode, launch_server


def test_shim_builds_once_and_answers_no_device(tmp_path):
    out = cpu_mode.build_shim(tmp_path)
    lib_path = out / cpu_mode.SHIM_NAME
    mtime = lib_path.stat().st_mtime_ns
    assert cpu_mode.build_shim(tmp_path) == out and lib_path.stat().st_mtime_ns == mtime
    lib = ctypes.CDLL(str(lib_path))
    version = ctypes.c_int(-1)
    assert lib.cuInit(0) == 100
    assert lib.cuDriverGetVersion(ctypes.byref(version)) == 100 and version.value == 0
    assert [p.name for p in out.iterdir() if p.name.startswith(".libcuda-")] == []


def test_missing_compiler_is_one_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(cpu_mode.CpuModeError, match="C compiler.*apt-get install gcc"):
        cpu_mode.build_shim(tmp_path / "shim")
    assert not (tmp_path / "shim" / cpu_mode.SHIM_NAME).exists()


def test_failed_compile_leaves_nothing_half_built(tmp_path, monkeypatch):
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'cc: broken' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(fake_cc))
    with pytest.raises(cpu_mode.CpuModeError, match="broken"):
        cpu_mode.build_shim(tmp_path / "shim")
    assert sorted(p.name for p in (tmp_path / "shim").iterdir()) == []


def test_read_only_checkout_and_home_are_named(monkeypatch):
    monkeypatch.delenv("SGL_ATOM_CACHE_DIR", raising=False)
    monkeypatch.setattr(cpu_mode, "_writable_dir", lambda path: False)
    with pytest.raises(cpu_mode.CpuModeError, match="read-only.*set SGL_ATOM_CACHE_DIR"):
        cpu_mode.cache_dir()


def test_unwritable_cache_dir_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SGL_ATOM_CACHE_DIR", str(blocker / "sub"))
    with pytest.raises(cpu_mode.CpuModeError, match="SGL_ATOM_CACHE_DIR=.* is not writable"):
        cpu_mode.cache_dir()


def test_core_lists_one_per_rank(monkeypatch):
    monkeypatch.delenv("SGL_ATOM_CPU_CORES", raising=False)
    assert cpu_mode.core_lists(2, cores=2) == "0|1"
    assert cpu_mode.core_lists(1, cores=2) == "0-1"
    assert cpu_mode.core_lists(2, cores=8) == "0-3|4-7"
    monkeypatch.setenv("SGL_ATOM_CPU_CORES", "0|1|2")
    with pytest.raises(cpu_mode.CpuModeError, match="3 core lists.*2 ranks"):
        cpu_mode.core_lists(2)


def test_cpu_mode_setting_is_validated(monkeypatch):
    monkeypatch.setenv("SGL_ATOM_CPU_MODE", "maybe")
    with pytest.raises(cpu_mode.CpuModeError, match="auto, on or off"):
        cpu_mode.cpu_mode_enabled()


def test_server_command_in_cpu_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("SGL_ATOM_CPU_MODE", "on")
    monkeypatch.setenv("SGL_ATOM_CACHE_DIR", str(tmp_path))
    cmd, env = launch_server.server_command(["--model-path", "m", "--tp", "2"])
    assert cmd[1:4] == ["-m", "sglang.launch_server", "--model-path"]
    assert cmd[-2:] == ["--device", "cpu"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(tmp_path / "cuda_shim")


def test_server_processes_start_without_gpu_only_imports(monkeypatch, tmp_path):
    """A CPU server's processes run sgl_atom's sitecustomize first: ``cutlass`` (the CuTe DSL)
    reads as absent, flashinfer still imports and reports it unavailable, and a sitecustomize
    already on the caller's PYTHONPATH still runs."""
    mine = tmp_path / "site"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITE_RAN'] = '1'\n")
    monkeypatch.setenv("SGL_ATOM_CPU_MODE", "on")
    monkeypatch.setenv("SGL_ATOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(mine))
    _, env = launch_server.server_command(["--model-path", "m"])
    assert env["PYTHONPATH"].split(":")[:2] == [str(cpu_mode.SITE_DIR), str(mine)]
    probe = (
        "import os, sys, importlib.util\n"
        "assert sys.modules['cutlass'] is None\n"
        "assert os.environ.get('SHADOWED_SITE_RAN') == '1'\n"
        "if importlib.util.find_spec('flashinfer') is not None:\n"
        "    from flashinfer.cute_dsl import is_cute_dsl_available\n"
        "    assert not is_cute_dsl_available()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])  # a server started from a server's env
    _, again = launch_server.server_command(["--model-path", "m"])
    assert again["PYTHONPATH"] == env["PYTHONPATH"]


def test_server_command_with_a_gpu_changes_nothing(monkeypatch):
    monkeypatch.setenv("SGL_ATOM_CPU_MODE", "off")
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    cmd, env = launch_server.server_command(["--model-path", "m"])
    assert cmd[3:] == ["--model-path", "m"]
    assert "SGLANG_USE_CPU_ENGINE" not in env


def test_num_ranks_reads_parallel_flags():
    assert launch_server.num_ranks(["--tp", "2"]) == 2
    assert launch_server.num_ranks(["--pp-size=2", "--tp-size", "2"]) == 4
    assert launch_server.num_ranks(["--model-path", "m", "--tensor-parallel", "2", "--dp=3"]) == 6
    assert launch_server.num_ranks([]) == 1


def test_launcher_reads_abbreviations_and_passes_the_rest():
    argv = [
        "--model-path",
        "m",
        "--attention-back",
        "atom",
        "--port=31000",
        "--pp-max-micro-batch-size",
        "4",
    ]
    assert launch_server.uses_atom_backend(argv)
    assert launch_server.read_flags(argv).port == 31000
    assert launch_server.num_ranks(argv) == 1  # --pp-max-micro-batch-size is not --pp-size
    assert not launch_server.uses_atom_backend(["--attention-backend", "triton"])
    assert launch_server.uses_atom_backend(["--decode-attention-backend=atom"])


def test_launcher_flags_are_sglang_flags():
    """Every flag the launcher reads is spelled, and lands in the same field, as in SGLang's own
    parser (so a rename upstream fails here)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    theirs = argparse.ArgumentParser()
    ServerArgs.add_cli_args(theirs)
    dest = {o: a.dest for a in theirs._actions for o in a.option_strings}
    for action in launch_server._parser()._actions:
        for option in action.option_strings:
            assert dest.get(option) == action.dest, option


def test_port_in_use_is_one_clear_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "sgl_atom.launch_server",
                "--model-path",
                "x",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr
    assert "another --port" in proc.stderr
