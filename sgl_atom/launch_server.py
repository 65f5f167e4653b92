"""``python -m sgl_atom.launch_server [SGLang server args]``: SGLang's launcher, made ready.

On a host with an NVIDIA driver this is exactly ``python -m sglang.launch_server``. On a host
without one (CPU reference mode, see :mod:`sgl_atom.cpu_mode`) it first builds the no-device
``libcuda.so.1`` shim, sets ``SGLANG_USE_CPU_ENGINE=1`` and one core list per rank, adds
``--device cpu``, and checks the port is free, so a bad set-up fails with one clear message.
"""

from __future__ import annotations

import os
import socket
import sys

from . import cpu_mode


def _flag_value(argv: list[str], names: tuple[str, ...], default: str) -> str:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return default


def num_ranks(argv: list[str]) -> int:
    """Ranks a launch starts (tp × pp × dp) as far as they need CPU core lists."""
    tp = int(_flag_value(argv, ("--tp-size", "--tp", "--tensor-parallel-size"), "1"))
    pp = int(_flag_value(argv, ("--pp-size", "--pp", "--pipeline-parallel-size"), "1"))
    dp = int(_flag_value(argv, ("--dp-size", "--dp", "--data-parallel-size"), "1"))
    return tp * pp * dp


ATTENTION_FLAGS = (
    "--attention-backend",
    "--prefill-attention-backend",
    "--decode-attention-backend",
)


def uses_atom_backend(argv: list[str]) -> bool:
    return any(_flag_value(argv, (flag,), "") == "atom" for flag in ATTENTION_FLAGS)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_port(argv: list[str]) -> None:
    host = _flag_value(argv, ("--host",), "127.0.0.1")
    port = int(_flag_value(argv, ("--port",), "30000"))
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
        if _flag_value(argv, ("--device",), "") == "":
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
