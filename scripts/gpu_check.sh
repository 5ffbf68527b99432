#!/usr/bin/env bash
# Every GPU check from a machine with a GPU. Each stage has its own time limit, so a slow stage
# costs its own figures, never the later ones; at most about 16 minutes in all, so on a lease of
# 10-minute calls split it in two (2026-11-28, H200, jax 0.11.2, fourth session: install ~30 s,
# tests 94 s, the five training steps 105 s compiling in parallel threads, the GEMM view
# ~130 s; the first call below took 255 s):
#   SECTIONS="train_step weight_only" FUSION=0 scripts/gpu_check.sh OUT1        (~9 min)
#   TESTS=0 GEMMS=0 SECTIONS="quantize dequantize nvfp4 mxfp8 encode" scripts/gpu_check.sh OUT2
#   1. the GPU-relevant tests on the GPU ($OUT/pytest.log): the gpu-marked tests and the quick
#      tier of the codec, MX, NVFP4, delayed-scaling, packing, kernel and matmul modules
#      (FULL=1: the whole suite);
#   2. the GPU benchmark (benchmarks/bench_gpu.py), one process per section so that each
#      keeps its figures: $OUT/bench_<section>.txt and .json, 3 interleaved rounds, two
#      matmul sizes, four weight-only cases and one transformer block's training step in each
#      recipe (bf16, FP8 delayed, FP8 current, MXFP8, NVFP4) (FULL=1: 9 rounds, every size);
#   3. the GEMMs of every product (gpu_hlo_report.py's GEMM view), $OUT/gemms.txt and .json;
#   4. with the time left, the fusion report (kernels per entry point), $OUT/hlo_report.txt,
#      the optimized HLO modules packed in $OUT/hlo.tar.gz.
# Usage: scripts/gpu_check.sh [OUT_DIR] (default: gpu_check_out). Environment: PYTHON (the
# interpreter, default python3); FULL=1 (no time limits, the whole suite and benchmark);
# ALLOW_CPU=1 (run without a GPU: a smoke test of this script); TUNE=1 (also sweep the MXFP4
# kernel's tiles at one token, $OUT/tune.txt: at most 4 minutes more); TUNE_PREPARED=1 (sweep
# the prepared-weight kernel's launch parameters, $OUT/tune_prepared.txt: at most 4 minutes
# more); SECTIONS="train_step nvfp4" (the benchmark sections to run, in that order; default
# all seven); TESTS=0, GEMMS=0, FUSION=0 (skip that stage: a lease split into two calls runs
# the tests and the first sections in one, the rest in the other). Exits non-zero if the
# tests fail or time out (after the benchmark). TARBALL=FILE also packs every output into
# FILE (.tgz), for a transport that takes few files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
FULL="${FULL:-0}"
# Read before the names are reused below.
RUN_TESTS="${TESTS:-1}" RUN_GEMMS="${GEMMS:-1}" RUN_FUSION="${FUSION:-1}"
SECTIONS="${SECTIONS:-train_step quantize dequantize nvfp4 mxfp8 weight_only encode}"
START=$SECONDS
# Tests and benchmarks share the device: allocate on demand instead of grabbing 75 % up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

stage() {  # stage SECONDS NAME COMMAND...: run COMMAND for at most SECONDS (0: no limit)
  local limit=$1 name=$2; shift 2
  echo "== $name (limit ${limit}s, at $((SECONDS - START))s)"
  if [[ "$FULL" == "1" || "$limit" == "0" ]]; then "$@"; return; fi
  # SIGINT first: pytest then stops and still prints its summary of what ran.
  timeout -s INT -k 15 "$limit" "$@"
  local rc=$?
  [[ $rc == 124 || $rc == 130 ]] && echo "== $name: stopped at its ${limit}s limit"
  return $rc
}

"$PY" -c 'import jax, jaxlib, sys; d = jax.devices()[0]
print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, python {sys.version.split()[0]}: "
      f"{d.platform} {d.device_kind}")' | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader \
  >>"$OUT/device.txt" 2>/dev/null
if [[ "${ALLOW_CPU:-0}" != "1" ]] && ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "gpu_check.sh: JAX sees no GPU (install jax[cuda12]); stopping" >&2
  exit 2
fi
# lowprec itself, from this checkout (no network: no build isolation, no dependencies).
if ! "$PY" -c 'import lowprec_formats' 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
    || { echo "gpu_check.sh: pip install -e . failed, see $OUT/install.log" >&2; exit 2; }
fi

XDIST=()
if "$PY" -c 'import xdist' 2>/dev/null; then XDIST=(-n 8); fi
if [[ "$FULL" == "1" ]]; then
  TEST_FILES=(tests)
  MARK=()
else
  TEST_FILES=(tests/test_codec.py tests/test_codec_properties.py tests/test_mx.py
         tests/test_mx_properties.py tests/test_mx_formats.py tests/test_pack.py
         tests/test_scale_schemes.py tests/test_ragged.py tests/test_random_words.py
         tests/test_fast_paths.py tests/test_delayed.py tests/test_nvfp4_train.py
         tests/test_kernels.py tests/test_matmul.py tests/test_matmul_elision.py tests/test_api.py
         tests/test_prepared_weight.py tests/test_gpu_routes.py)
  MARK=(-m "gpu or not slow")
fi
tests_rc=0
if [[ "$RUN_TESTS" != "0" ]]; then
  # XLA's own flags: the suite's CPU compile flags (tests/helpers/xla_opt.py) are not for a GPU.
  LOWPREC_TEST_XLA_OPT=default stage 200 tests "$PY" -m pytest -ra -p no:cacheprovider --durations=10 "${XDIST[@]}" \
    "${MARK[@]}" "${TEST_FILES[@]}" 2>&1 | tee "$OUT/pytest.log"
  tests_rc=${PIPESTATUS[0]}
fi

BENCH=(--reps 3 --matmul-sizes 4096 8192)
# Each weight-only route is timed as the difference of two programs of R/4 and R products,
# every product unrolled (all twelve shapes at R = 32 took over 100 s to compile on an H200).
WEIGHTS=(--weight-shapes 4096x4096 16384x8192 --tokens 1 16 --inner 8)
[[ "$FULL" == "1" ]] && BENCH=() && WEIGHTS=()
first=1
# weight_only also times the prepared-weight kernel (MXFP4 and NVFP4) against bfloat16.
declare -A LIMIT=([train_step]=240 [quantize]=70 [dequantize]=45 [nvfp4]=40 [mxfp8]=70
                  [weight_only]=140 [encode]=35)
for section in $SECTIONS; do
  [[ -n "${LIMIT[$section]:-}" ]] || { echo "gpu_check.sh: no section $section" >&2; exit 2; }
  set -- "$section" "${LIMIT[$section]}"
  extra=()
  [[ $first == 1 && -f "$OUT/pytest.log" ]] && extra=(--pytest-log "$OUT/pytest.log")
  [[ $1 == weight_only ]] && extra=("${WEIGHTS[@]}")
  # Each low-precision step's kernels too (a few steps under jax.profiler): the listing that
  # showed delayed scaling's float32 GEMMs.
  [[ $1 == train_step ]] && extra+=(--profile fp8_delayed fp8_current mxfp8 nvfp4)
  first=0
  stage "$2" "bench $1" "$PY" benchmarks/bench_gpu.py --only "$1" "${BENCH[@]}" "${extra[@]}" \
    --json "$OUT/bench_$1.json" 2>&1 | tee "$OUT/bench_$1.txt"
done
if [[ "${TUNE:-0}" == "1" ]]; then  # the MXFP4 kernel's tiles at one token, 16384 x 8192
  stage 240 "tune" "$PY" benchmarks/bench_gpu.py --tune --reps 3 --weight-shapes 16384x8192 \
    --tokens 1 --inner 8 2>&1 | tee "$OUT/tune.txt"
fi
if [[ "${TUNE_PREPARED:-0}" == "1" ]]; then  # the prepared-weight kernel's launch parameters
  stage 240 "tune prepared" "$PY" benchmarks/bench_gpu.py --tune-prepared --reps 3 \
    --weight-shapes 4096x4096 16384x8192 --tokens 1 16 --inner 8 2>&1 | tee "$OUT/tune_prepared.txt"
fi

# Which GEMM every product gets on this device's compiler (the GEMM view, Triton GEMM off).
[[ "$RUN_GEMMS" != "0" ]] && stage 150 "GEMM view" "$PY" benchmarks/gpu_hlo_report.py --gemms only --json "$OUT/gemms.json" \
  2>&1 | tee "$OUT/gemms.txt"

left=$((900 - (SECONDS - START)))
[[ "$FULL" == "1" ]] && left=0
if [[ "$RUN_FUSION" != "0" ]] && [[ "$FULL" == "1" || $left -gt 30 ]]; then
  stage "$left" "fusion report" "$PY" benchmarks/gpu_hlo_report.py --gemms none --dump "$OUT/hlo" 2>&1 \
    | tee "$OUT/hlo_report.txt"
  tar -czf "$OUT/hlo.tar.gz" -C "$OUT" hlo 2>/dev/null && rm -rf "$OUT/hlo"
fi
[[ -n "${TARBALL:-}" ]] && tar -czf "$TARBALL" -C "$(dirname "$OUT")" "$(basename "$OUT")"
echo "gpu_check.sh: tests exit ${tests_rc} after $((SECONDS - START))s; outputs in $OUT/"
exit "$tests_rc"
