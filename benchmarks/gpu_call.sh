#!/usr/bin/env bash
# One device call on the lent H200 (see README "On a GPU"): brings SGLang up from the offline
# bundle in .gpu/, then runs what is asked, logs and results under $OUT.
#   bash benchmarks/gpu_call.sh kernels|tier|bench-quick|bench|bench-spec|tune-decode|nixl [extra bench args]
# The bundle: parts 1 and 2 from ../shared/gpu/bundle.sh, part 3 (NIXL for the atom P/D backend)
# from scripts/gpu_bundle_pd.sh; part 3 is small enough to travel with part 1.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/device-env.sh || exit $?
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
what=$1; shift
case "$what" in
  kernels) python3 -m pytest -q tests/gpu --ignore=tests/gpu/test_server_tier.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" ;;
  tier) python3 -m pytest -q -rsx tests/gpu/test_server_tier.py 2>&1 | tee "$OUT/gpu_server_tests.log"
        for f in /tmp/sgl_atom-*.log; do [ -f "$f" ] && tail -n 60 "$f"; done > "$OUT/tier_server_tails.log" ;;
  bench-quick) python3 benchmarks/bench_server.py --quick --out "$OUT" --logs "$OUT" "$@" 2>&1 | tee "$OUT/bench_server.log" ;;
  bench) python3 benchmarks/bench_server.py --out "$OUT" --logs "$OUT" "$@" 2>&1 | tee "$OUT/bench_server.log" ;;
  bench-spec) python3 benchmarks/bench_server.py --spec --output 128 --out "$OUT" --logs "$OUT" "$@" 2>&1 | tee "$OUT/bench_server_spec.log" ;;
  tune-decode) python3 benchmarks/tune_decode_keys_major.py "$@" 2>&1 | tee "$OUT/tune_decode_keys_major.log" ;;
  nixl) python3 -c 'import nixl._api, nixl; print("nixl", nixl.__file__)' 2>&1 | tee "$OUT/nixl_import.log"
        python3 -m pytest -q tests/gpu/test_nixl_vram.py 2>&1 | tee -a "$OUT/nixl_import.log" ;;
  *) echo "usage: gpu_call.sh kernels|tier|bench-quick|bench|bench-spec|tune-decode|nixl [args]"; exit 2 ;;
esac
