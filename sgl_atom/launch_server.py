"""``python -m sgl_atom.launch_server [SGLang server args]``: SGLang's launcher, made ready.

On a host with an NVIDIA driver this is exactly ``python -m sglang.launch_server``. On a host
without one (CPU reference mode, see :mod:`sgl_atom.cpu_mode`) it first builds the no-device
``libcuda.so.1`` shim, sets ``SGLANG_USE_CPU_ENGINE=1`` and one core list per rank, adds
``--device cpu``, and checks the port is free, so a bad set-up fails with one clear message.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from . import cpu_mode

ATTENTION_FLAGS = (
    "--attention-backend",
    "--prefill-attention-backend",
    "--decode-attention-backend",
)


def _parser() -> argparse.ArgumentParser:
    """The few SGLang flags the launcher reads; every other argument goes to SGLang untouched.

    Spellings and abbreviations are argparse's, as in SGLang's own parser (``--tp 2`` is
    ``--tp-size 2`` there too); defaults are SGLang's."""
    p = argparse.ArgumentParser(prog="sgl_atom.launch_server", add_help=False)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pp-size", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="")
    for flag in ATTENTION_FLAGS:
        p.add_argument(flag, default="")
    return p


def read_flags(argv: list[str]) -> argparse.Namespace:
    return _parser().parse_known_args(argv)[0]


def num_ranks(argv: list[str]) -> int:
    """Ranks a launch starts (tp × pp × dp) as far as they need CPU core lists."""
    flags = read_flags(argv)
    return flags.tp_size * flags.pp_size * flags.dp_size


def uses_atom_backend(argv: list[str]) -> bool:
    flags = read_flags(argv)
    return "atom" in (
        flags.attention_backend,
        flags.prefill_attention_backend,
        flags.decode_attention_backend,
    )


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_port(argv: list[str]) -> None:
    flags = read_flags(argv)
    host, port = flags.host, flags.port
    if not port_free(host, port):
        raise SystemExit(
            f"sgl_atom: port {port} on {host} is already in use: stop the process holding it "
            f"or pass another --port"
        )


def server_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start SGLang's server with these arguments."""
    argv = list(argv)
    env = dict(os.environ)
    if cpu_mode.cpu_mode_enabled():
        env = cpu_mode.server_env(num_ranks(argv), env)
        if read_flags(argv).device == "":
            argv += ["--device", "cpu"]
        if uses_atom_backend(argv):
            env["TRITON_INTERPRET"] = "1"  # the atom kernels run in Triton's interpreter
    return [sys.executable, "-m", "sglang.launch_server", *argv], env


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_port(argv)
        cmd, env = server_command(argv)
    except cpu_mode.CpuModeError as e:
        raise SystemExit(f"sgl_atom: {e}") from None
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
