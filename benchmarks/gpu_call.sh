#!/usr/bin/env bash
# One device call on the lent H200 (see README "On a GPU"): brings SGLang up from the offline
# bundle in .gpu/, then runs what is asked, logs and results under $OUT.
#   bash benchmarks/gpu_call.sh all|kernels|tune-kernels|ncu-decode|sparse-scoring|draft-block|tier|bench-quick|bench|bench-m3|bench-pd|bench-spec|tune-decode|tune-verify|nixl|pack
# Several modes in one call: GPU_CALL_NESTED=1 for each, then `gpu_call.sh pack` last.
# GPU_CALL_UNTIL (epoch seconds, e.g. $(( $(date +%s) + 580 )) set once at the call's start) caps
# each mode's main command so that it ends UNTIL_MARGIN s (default 15) before then: the servers'
# log tails and the pack still run. An outer `timeout` would kill them with the mode.
# kernels, tune-decode, tune-verify, tune-kernels, ncu-decode, sparse-scoring and draft-block need torch and
# Triton only: they run on part 1 alone (the first call of the two-call routine), or with no
# bundle at all.
# tune-kernels writes the measured decode tuning into a copy of the device's committed tuning file, if any (its
# verify entry kept; tune-verify likewise keeps the decode one) at
# $OUT/decode_tuning.json and /tmp/decode_tuning.json (kept while the machine is warm); later
# calls use it with SGL_ATOM_DECODE_TUNING=/tmp/decode_tuning.json. It then writes the kernel's
# resources as Triton compiles it here, profiles the tuned decode (ncu-decode) and runs the
# kernel tests.
# GPU_BUNDLE names the bundle folder (default .gpu). The bundle: parts 1 and 2 from ../shared/gpu/bundle.sh, part 3 (NIXL for the atom P/D backend)
# from scripts/gpu_bundle_pd.sh; part 3 is small enough to travel with part 1. Part 4 (SGLang's PD
# router, scripts/gpu_bundle_router.sh) travels in a call of its own between those two.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?usage: gpu_call.sh WHAT [args]}; shift
case "$what" in
  kernels|tune-decode|tune-verify|tune-kernels|ncu-decode|sparse-scoring|draft-block)
    # shellcheck disable=SC1091
    source "${GPU_BUNDLE:-.gpu}/device-env.sh" || {
      echo "gpu_call: SGLang bundle incomplete; $what needs torch and Triton only"
      export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
      [ -e sgl_atom/kernels ] || ln -s ../kernels sgl_atom/kernels
    } ;;
  *) source "${GPU_BUNDLE:-.gpu}/device-env.sh" || exit $? ;;
esac
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# At most 8 files come back from a device call: past that, everything is packed into
# $OUT/all.tar.gz (the mode's main logs stay beside it, readable at once).
pack_out() {
  local n; n=$(find "$OUT" -type f | wc -l)
  [ "$n" -le 8 ] && return
  tar czf /tmp/all.tar.gz -C "$OUT" . && mv /tmp/all.tar.gz "$OUT/all.tar.gz"
  find "$OUT" -type f ! -name all.tar.gz ! -name 'gpu_*tests.log' ! -name 'bench_server*.log' \
    ! -name 'tune_decode.log' ! -name 'tune_verify.log' ! -name 'decode_tuning.json' -delete
  find "$OUT" -mindepth 1 -type d -empty -delete
}
[ "${GPU_CALL_NESTED:-}" ] || trap pack_out EXIT
export GPU_CALL_NESTED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
# A mode cut by `timeout` may leave SGLang servers behind (each runs in its own session, out of
# reach of the signal), holding the card's memory for the next mode: stopped after each mode that
# starts servers. The pattern does not match this script's own command line.
stop_servers() { pkill -f '[s]glang.launch_server' && sleep 5; pkill -9 -f '[s]glang.launch_server'; true; }
# `capped SECONDS cmd...`: cmd under `timeout`, at most SECONDS and at most until GPU_CALL_UNTIL
# less the margin (nothing runs when that has passed: exit 124, as for a command cut short)
capped() {
  local cap=$1; shift
  if [ -n "${GPU_CALL_UNTIL:-}" ]; then
    local left=$(( GPU_CALL_UNTIL - $(date +%s) - ${UNTIL_MARGIN:-15} ))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -le 0 ]; then echo "gpu_call: no time left before GPU_CALL_UNTIL for: $*"; return 124; fi
  fi
  timeout "$cap" "$@"
}
# the last lines of every tier server's log (kept when a run is cut), then no server left behind
tier_tails() {
  for f in /tmp/sgl_atom-*.log; do [ -f "$f" ] && tail -n 60 "$f"; done > "$OUT/tier_server_tails.log"
  stop_servers
}
# the tuning file a sweep writes into: an earlier sweep's (kept while the machine is warm), else a
# copy of this device's committed file, else none (the sweep starts a new one)
seed_tuning() {
  [ -f /tmp/decode_tuning.json ] && return
  local file
  file=$(python3 -c 'import torch; from sgl_atom.attention.decode_tuning import device_file
print(device_file(torch.cuda.get_device_name(0)))')
  [ -f "$file" ] && cp "$file" /tmp/decode_tuning.json
  return 0
}
kernel_tests() {
  python3 -m pytest -q -rs tests/gpu --ignore=tests/gpu/test_server_tier.py 2>&1 | tee "$OUT/gpu_kernel_tests.log"
}
case "$what" in  # servers left by an earlier mode that was killed from outside hold the card
  all|tier|bench*) pgrep -f '[s]glang.launch_server' > /dev/null \
    && { echo "gpu_call: stopping SGLang servers left by an earlier mode"; stop_servers; } ;;
esac
case "$what" in
  kernels) kernel_tests ;;
  tune-kernels)
    # the sweep's decode picks go into a copy of the committed file, its verify entry kept
    seed_tuning
    python3 benchmarks/tune_decode.py --write-config /tmp/decode_tuning.json "$@" 2>&1 \
      | tee "$OUT/tune_decode.log"
    cp /tmp/decode_tuning.json "$OUT/decode_tuning.json"
    python3 benchmarks/kernel_resources.py --maxnreg 128 > "$OUT/kernel_resources.log" 2>&1
    [ -f /tmp/decode_tuning.json ] && export SGL_ATOM_DECODE_TUNING=/tmp/decode_tuning.json
    timeout 150 bash "$0" ncu-decode > /dev/null 2>&1
    kernel_tests ;;
  all) # the whole of tests/gpu in one pytest run: the server tier on one xdist worker, the kernel
       # modules on the others (part 3 carries pytest-xdist), capped like the tier
       capped "${TIER_TIMEOUT:-560}" python3 -m pytest -q -rsx tests/gpu -n 4 --dist loadfile "$@" 2>&1 \
         | tee "$OUT/gpu_tests.log"
       tier_tails ;;
  tier) # the pytest run is capped (TIER_TIMEOUT s) so the servers' log tails are kept when it is cut
        capped "${TIER_TIMEOUT:-560}" python3 -m pytest -q -rsx tests/gpu/test_server_tier.py "$@" 2>&1 \
          | tee "$OUT/gpu_server_tests.log"
        tier_tails ;;
  bench-quick) capped 600 python3 benchmarks/bench_server.py --quick --out "$OUT" --logs "$OUT" "$@" 2>&1 | tee "$OUT/bench_server.log"; stop_servers ;;
  bench) capped 600 python3 benchmarks/bench_server.py --out "$OUT" --logs "$OUT" "$@" 2>&1 | tee "$OUT/bench_server.log"; stop_servers ;;
  bench-m3) capped 600 python3 benchmarks/bench_server.py --m3 --output 64 --out "$OUT" --logs "$OUT" "$@" 2>&1 | tee "$OUT/bench_server_m3.log"; stop_servers ;;
  bench-pd) capped 600 python3 benchmarks/bench_server.py --pd --out "$OUT" --logs "$OUT" "$@" 2>&1 | tee "$OUT/bench_server_pd.log"; stop_servers ;;
  bench-spec) capped 600 python3 benchmarks/bench_server.py --spec --output 128 --out "$OUT" --logs "$OUT" "$@" 2>&1 | tee "$OUT/bench_server_spec.log"; stop_servers ;;
  ncu-decode)
    for kv in bf16 fp8; do
      ncu --clock-control none --kernel-name regex:decode_fwd_kernel --launch-skip 2 \
        --launch-count 1 --set full --import-source yes -f -o "/tmp/decode_$kv" \
        python3 benchmarks/profile_decode.py --kv $kv "$@" >> "$OUT/ncu_decode.log" 2>&1
      ncu --import "/tmp/decode_$kv.ncu-rep" --page details > "$OUT/decode_${kv}_details.txt" 2>&1
      ncu --import "/tmp/decode_$kv.ncu-rep" --page source --print-source sass --csv \
        > "/tmp/decode_${kv}_sass.csv" 2>&1
    done
    python3 benchmarks/profile_decode.py --summarize /tmp/decode_bf16_sass.csv \
      /tmp/decode_fp8_sass.csv > "$OUT/ncu_decode_summary.txt" 2>&1
    tail -n 40 "$OUT"/ncu_decode_summary.txt ;;
  sparse-scoring) # the sparse kernel tests (both 4-bit dot paths), the 4-bit scoring probe, then
                  # the sparse benchmark at the kernel target's context
    python3 -m pytest -q tests/gpu/test_sparse_kernels.py 2>&1 | tee "$OUT/sparse_attention_gpu_tests.log"
    (cd benchmarks && capped 240 python3 probe_int4_scoring.py) 2>&1 | tee "$OUT/probe_int4_scoring.log"
    (cd benchmarks && capped 300 python3 bench_sparse_attention.py --out "$OUT" --contexts 131072 --index fp8,int4,int4-f16 "$@") \
      2>&1 | tee "$OUT/sparse_attention.log" ;;
  draft-block) # the DSpark draft's block attention: default vs the device's verify tiling, timed
                # at the 8B shapes, then every committed tiling at that shape against float64
    python3 benchmarks/bench_draft_block.py --out "$OUT" "$@" 2>&1 | tee "$OUT/draft_block.log"
    python3 -m pytest -q tests/gpu/test_dense_kernels.py -k draft_block 2>&1 | tee "$OUT/gpu_draft_block_tests.log" ;;
  pack) pack_out ;;  # packs what earlier nested calls left in $OUT (GPU_CALL_NESTED=1 or not)
  tune-decode) python3 benchmarks/tune_decode.py "$@" 2>&1 | tee "$OUT/tune_decode.log" ;;
  tune-verify) # the verify tiles' registers and occupancy as this Triton compiles them, then timed;
               # the best tilings go into a copy of the device's tuning file (the one an earlier
               # tune-kernels wrote, else the device's committed one): $OUT/decode_tuning.json and
               # /tmp/decode_tuning.json, for SGL_ATOM_DECODE_TUNING in later calls
    python3 benchmarks/kernel_resources.py --verify > "$OUT/kernel_resources_verify.log" 2>&1
    seed_tuning
    python3 benchmarks/tune_verify.py --write-config /tmp/decode_tuning.json "$@" 2>&1 \
      | tee "$OUT/tune_verify.log"
    cp /tmp/decode_tuning.json "$OUT/decode_tuning.json" ;;
  nixl) python3 -c 'import nixl._api, nixl; print("nixl", nixl.__file__)' 2>&1 | tee "$OUT/nixl_import.log"
        python3 -m pytest -q tests/gpu/test_nixl_vram.py 2>&1 | tee -a "$OUT/nixl_import.log" ;;
  *) echo "usage: gpu_call.sh all|kernels|tune-kernels|ncu-decode|sparse-scoring|draft-block|tier|bench-quick|bench|bench-m3|bench-pd|bench-spec|tune-decode|tune-verify|nixl|pack [args]"; exit 2 ;;
esac
