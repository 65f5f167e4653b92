"""Run at start-up by every process of a CPU-mode SGLang server: `sgl_atom.cpu_mode.server_env`
puts this folder first on ``PYTHONPATH`` (CPU reference mode only, never on a host with a driver).

NVIDIA's CuTe DSL (the ``cutlass`` package) only builds GPU kernels, yet flashinfer imports it
whenever it is installed, and SGLang imports flashinfer on every path: about 3 s of each
process's start-up on a 2-core host, and a CPU server starts three processes. Marking it absent
makes flashinfer report the DSL unavailable, as on a host without it. A ``sitecustomize`` this
one shadows still runs after it.
"""

import importlib.machinery
import importlib.util
import os
import sys

sys.modules.setdefault("cutlass", None)


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_run_shadowed()
