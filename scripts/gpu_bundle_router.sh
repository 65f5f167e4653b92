#!/usr/bin/env bash
# Builds part 4 of the offline GPU bundle: SGLang's PD router (sglang-router 0.3.2, the version
# pyproject.toml pins), so the GPU tier's P/D soak goes through the router as users run it.
# The wheel's Rust extension is stripped of its symbols (92 -> 72 MB, 17 MB packed); the part
# travels in a call of its own on a warm machine, between the calls of parts 1(+3) and 2, from a
# folder that also holds device-env.sh (it unpacks every part-*.tar.xz it is given):
#   bash scripts/gpu_bundle_router.sh .gpuR && cp .gpu/device-env.sh .gpu/sitecustomize.py .gpuR/
# The router's Python dependencies (aiohttp, fastapi, orjson, setproctitle, uvicorn) come with
# SGLang's parts.
set -euo pipefail
OUT=${1:?usage: gpu_bundle_router.sh OUTDIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
echo "[bundle-router] 1/2 downloading sglang-router==0.3.2 (abi3, manylinux2014)"
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
  -d "$W/whl" sglang-router==0.3.2 2>&1 | grep -v "^WARNING: Location" || true
mkdir -p "$W/site"
for w in "$W"/whl/*.whl; do (cd "$W/site" && python3 -m zipfile -e "$w" .); done
so=$(ls "$W"/site/sglang_router/*.so)
strip --strip-unneeded "$so"
echo "[bundle-router] 2/2 packing"
(cd "$W/site" && tar -cf - . | xz -T0 -9 > "$OUT/part-4.tar.xz")
echo "[bundle-router] done: $(du -h "$OUT/part-4.tar.xz" | cut -f1) in $OUT/part-4.tar.xz"
