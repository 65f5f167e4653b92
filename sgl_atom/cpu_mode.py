"""CPU reference mode: serve real SGLang on a host with no NVIDIA driver.

SGLang 0.5.23 serves on CPU with ``SGLANG_USE_CPU_ENGINE=1 --device cpu``, provided its CUDA
kernel package can be imported; that needs a ``libcuda.so.1``. Here we build a no-device one
from ``csrc/cuda_shim.c`` and compute the environment a server process needs. On a host with a
driver nothing here is applied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import envs

SHIM_SOURCE = Path(__file__).parent / "csrc" / "cuda_shim.c"
SHIM_NAME = "libcuda.so.1"
# a sitecustomize every CPU-server process runs first (it keeps GPU-only imports out)
SITE_DIR = Path(__file__).parent / "cpu_site"


class CpuModeError(RuntimeError):
    """A CPU-mode prerequisite is missing; the message names it and the fix."""


def has_nvidia_driver() -> bool:
    """True when this host has an NVIDIA kernel driver (so the real libcuda exists)."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def cpu_mode_enabled() -> bool:
    """Whether CPU reference mode applies, from SGL_ATOM_CPU_MODE (auto|on|off)."""
    mode = envs.SGL_ATOM_CPU_MODE.get().strip().lower()
    if mode not in ("auto", "on", "off"):
        raise CpuModeError(f"SGL_ATOM_CPU_MODE={mode!r}: use auto, on or off")
    if mode == "auto":
        return not has_nvidia_driver()
    return mode == "on"


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def cache_dir() -> Path:
    """Directory for built artefacts: SGL_ATOM_CACHE_DIR, else <checkout>/.cache, else ~/.cache."""
    if envs.SGL_ATOM_CACHE_DIR.is_set():
        path = Path(envs.SGL_ATOM_CACHE_DIR.get()).expanduser()
        if not _writable_dir(path):
            raise CpuModeError(
                f"SGL_ATOM_CACHE_DIR={path} is not writable: point it at a writable directory"
            )
        return path
    for path in (
        Path(__file__).resolve().parent.parent / ".cache",
        Path.home() / ".cache" / "sgl_atom",
    ):
        if _writable_dir(path):
            return path
    raise CpuModeError(
        "no writable cache directory (the checkout and ~/.cache are read-only): "
        "set SGL_ATOM_CACHE_DIR to a writable directory"
    )


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise CpuModeError(
            "CPU reference mode needs a C compiler to build its no-device libcuda.so.1 shim, and "
            "none was found (cc/gcc/clang): install one (e.g. `apt-get install gcc`) or set CC"
        )
    return cc


def build_shim(out_dir: Path | None = None) -> Path:
    """Build the no-device ``libcuda.so.1`` (once); returns the directory holding it.

    The library is compiled to a temporary name and renamed into place, so an interrupted or
    failed build never leaves a half-written library behind.
    """
    out_dir = out_dir or cache_dir() / "cuda_shim"
    target = out_dir / SHIM_NAME
    stamp = out_dir / "source.sha"
    digest = _source_digest()
    if target.exists() and stamp.exists() and stamp.read_text() == digest:
        return out_dir
    if not _writable_dir(out_dir):
        raise CpuModeError(f"cannot write the CUDA shim to {out_dir}: set SGL_ATOM_CACHE_DIR")
    cc = _compiler()
    fd, tmp = tempfile.mkstemp(prefix=".libcuda-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run(
            [
                cc,
                "-shared",
                "-fPIC",
                "-O2",
                "-Wl,-soname," + SHIM_NAME,
                "-o",
                tmp,
                str(SHIM_SOURCE),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise CpuModeError(f"building the CUDA shim with {cc} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, target)
        stamp.write_text(digest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_dir


def _source_digest() -> str:
    import hashlib

    return hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()


def core_lists(num_ranks: int, cores: int | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND value: one core list per rank, '|'-separated."""
    if envs.SGL_ATOM_CPU_CORES.is_set():
        value = envs.SGL_ATOM_CPU_CORES.get()
        if len(value.split("|")) != num_ranks:
            raise CpuModeError(
                f"SGL_ATOM_CPU_CORES={value!r} has {len(value.split('|'))} core lists but the "
                f"server has {num_ranks} ranks: give one list per rank, '|'-separated"
            )
        return value
    cores = cores or len(os.sched_getaffinity(0))
    per = max(1, cores // num_ranks)
    lists = []
    for r in range(num_ranks):
        lo = (r * per) % cores
        hi = min(lo + per, cores) - 1
        lists.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return "|".join(lists)


def server_env(num_ranks: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a CPU-mode SGLang server needs (shim on the library path, CPU engine,
    :data:`SITE_DIR` first on ``PYTHONPATH``)."""
    env = dict(os.environ if base is None else base)
    shim_dir = str(build_shim())
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != shim_dir]
    env["LD_LIBRARY_PATH"] = ":".join([shim_dir, *paths])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    site = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *site])
    env["SGLANG_CPU_OMP_THREADS_BIND"] = core_lists(num_ranks)
    # A P/D prefill's early send of a radix-cached prefix records a CUDA event (overlap schedule)
    env.setdefault("SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "0")
    return env
