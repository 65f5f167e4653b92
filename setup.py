"""Maps the top-level kernels/ folder to the package sgl_atom.kernels.

SGLang depends on an unrelated PyPI package named ``kernels``, so our kernels must never be
importable as a top-level ``kernels``.
"""

from setuptools import find_packages, setup

packages = ["sgl_atom", "sgl_atom.csrc"] + [f"sgl_atom.{p}" for p in find_packages("sgl_atom")]
packages += ["sgl_atom.kernels"] + [f"sgl_atom.kernels.{p}" for p in find_packages("kernels")]
packages += ["sgl_atom.attention.tuned", "sgl_atom.cpu_site"]  # data only (json; sitecustomize)

setup(
    packages=packages,
    package_data={
        "sgl_atom.csrc": ["*.c"],
        "sgl_atom.attention.tuned": ["*.json"],
        "sgl_atom.cpu_site": ["sitecustomize.py"],
    },
    package_dir={"sgl_atom": "sgl_atom", "sgl_atom.kernels": "kernels"},
)
