#!/usr/bin/env bash
# Builds the third part of the offline GPU bundle: NIXL for CUDA 13 (the atom P/D transfer
# backend on the lent H200) and pytest-xdist (tests/gpu's kernel modules beside the server tier), as .gpu/part-3.tar.xz beside the two SGLang parts that
# ../shared/gpu/bundle.sh writes. device-env.sh unpacks every part-*.tar.xz it is given into
# /tmp/site, so part 3 travels in a call of its own on a warm machine (after parts 1 and 2):
#   bash scripts/gpu_bundle_pd.sh .gpu
# Kept from the nixl-cu13 wheel: the Python package, the UCX backend plugin and UCX's transports
# (cuda_copy, cuda_ipc, tcp), and the shared libraries those need (their ELF NEEDED closure);
# dropped: NIXL's expert-parallel kernels (nixl_ep, 91 MB), the storage and fabric plugins
# (GDS, POSIX, OBJ/S3, Azure, GPUNETIO, ...), UCX's perftest modules.
set -euo pipefail
OUT=${1:?usage: gpu_bundle_pd.sh OUTDIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
echo "[bundle-pd] 1/3 downloading nixl==1.5.1, nixl-cu13==1.5.1 and pytest-xdist for Python 3.12"
python3 -m pip download -q --no-deps $PLAT -d "$W/whl" nixl==1.5.1 nixl-cu13==1.5.1 \
  pytest-xdist==3.8.0 execnet==2.1.2 2>&1 \
  | grep -v "^WARNING: Location" || true
mkdir -p "$W/site"
for w in "$W"/whl/*.whl; do (cd "$W/site" && python3 -m zipfile -e "$w" .); done
echo "[bundle-pd] 2/3 keeping the UCX path's libraries"
python3 - "$W/site" <<'PY'
import glob, os, shutil, subprocess, sys

os.chdir(sys.argv[1])
shutil.rmtree("nixl_ep_cu13", ignore_errors=True)
files = [f for f in glob.glob("**/*.so*", recursive=True) + glob.glob(".*/**/*.so*", recursive=True)]
by_name = {os.path.basename(f): f for f in files}

def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    return [ln.split("[")[1].split("]")[0] for ln in out.splitlines() if "(NEEDED)" in ln]

roots = glob.glob("nixl_cu13/*.so") + [f for f in files if f.endswith("libplugin_UCX.so")]
roots += [f for f in glob.glob("nixl_cu13.libs/ucx/*.so*") if "perftest" not in f]
roots += [f for f in files if "libnuma" in f]  # UCX opens it at run time
keep, todo = set(), list(roots)
while todo:
    f = todo.pop()
    if f not in keep:
        keep.add(f)
        todo += [by_name[n] for n in needed(f) if n in by_name]
dropped = [f for f in files if f not in keep]
for f in dropped:
    os.remove(f)
print(f"[bundle-pd] kept {len(keep)} shared libraries, dropped {len(dropped)}")
PY
echo "[bundle-pd] 3/3 packing"
(cd "$W/site" && tar -cf - . | xz -T0 -9 > "$OUT/part-3.tar.xz")
echo "[bundle-pd] done: $(du -h "$OUT/part-3.tar.xz" | cut -f1) in $OUT/part-3.tar.xz"
