#!/usr/bin/env bash
# Every GPU check from a machine with a GPU, in one command:
#   1. the whole test suite on the GPU (gpu-marked tests included), output in $OUT/pytest.log;
#   2. the fusion report (kernels per entry point), $OUT/hlo_report.txt, HLO modules in $OUT/hlo/;
#   3. the GPU benchmark (benchmarks/bench_gpu.py) with the pytest summary on top,
#      $OUT/bench_gpu.txt and $OUT/bench_gpu.json.
# Usage: scripts/gpu_check.sh [OUT_DIR] (default: gpu_check_out). Set TUNE=1 to also sweep the
# MXFP4 kernel's tiles ($OUT/tune.txt). Exits non-zero if the tests fail (after the benchmark).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
# Tests and benchmarks share the device: allocate on demand instead of grabbing 75 % up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

"$PY" -c 'import jax; d = jax.devices()[0]; print(jax.__version__, d.platform, d.device_kind)' \
  | tee "$OUT/device.txt"
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "gpu_check.sh: JAX sees no GPU (install jax[cuda12]); stopping" >&2
  exit 2
fi

XDIST=()
if "$PY" -c 'import xdist' 2>/dev/null; then XDIST=(-n 4); fi
"$PY" -m pytest -ra -p no:cacheprovider "${XDIST[@]}" 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

"$PY" benchmarks/gpu_hlo_report.py --dump "$OUT/hlo" 2>&1 | tee "$OUT/hlo_report.txt"
"$PY" benchmarks/bench_gpu.py --pytest-log "$OUT/pytest.log" --json "$OUT/bench_gpu.json" \
  2>&1 | tee "$OUT/bench_gpu.txt"
if [[ "${TUNE:-0}" == "1" ]]; then
  "$PY" benchmarks/bench_gpu.py --tune 2>&1 | tee "$OUT/tune.txt"
fi
echo "gpu_check.sh: tests exit ${tests_rc}; outputs in $OUT/"
exit "$tests_rc"
