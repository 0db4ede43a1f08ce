#!/usr/bin/env bash
# One prepared GPU check of the Triton kernels, for a borrowed CUDA machine:
#   1. makes batchgen (and batchgen.kernels, which lives in kernels/) importable from this checkout,
#   2. runs the CUDA kernel tests compiled for real (pytest -m gpu: tests/test_kernels.py and the engine's
#      triton-vs-torch greedy test tests/test_attention_e2e.py; the LoRA and weight-only quantized GEMMs),
#   3. runs the kernel benchmark (python -m batchgen.bench.kernels),
#   4. runs the weight-only GEMM benchmark with its tile sweep (python -m batchgen.bench.quant_gemm --sweep).
# Logs go to $OUT (default: a new /tmp/gpu_check.* folder): check.log, env.txt, pytest_gpu.log, pytest_gpu.xml,
# bench_kernels.log, bench_kernels.json, bench_quant_gemm.log, bench_quant_gemm.json. Budget: under 8 minutes on
# an H200 even when every step runs into its timeout (install 45 s, tests 150 s, benchmarks 140 s and 150 s);
# measured on an H200: tests 112 s (compiles spread over xdist workers), kernel benchmark 27 s, GEMM benchmark
# and its sweep about 85 s together. Exit status: non-zero if the tests or the kernel benchmark failed (or timed
# out).
#
#   bash jobs/gpu/check.sh             # on the GPU machine, from the repository root
#   bash jobs/gpu/check.sh --dry-run   # anywhere (no GPU): same steps, benchmark grid only
#
# Environment: PYTHON (default python3), OUT, TEST_TIMEOUT (s, default 150), BENCH_TIMEOUT (s, default 140),
# CHECK_NO_PIP=1 (skip the editable install and use the symlink + PYTHONPATH fallback).
set -uo pipefail

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$OUT"
LOG="$OUT/check.log"
START=$(date +%s)
log() { echo "[check +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

log "repo $REPO, python $PY, out $OUT, dry-run $DRY_RUN"
{
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" - <<'PYEOF' 2>&1
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("triton", "transformers", "pytest", "xdist", "flash_attn"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(name, "not importable:", type(e).__name__)
PYEOF
} > "$OUT/env.txt"
cat "$OUT/env.txt" >> "$LOG"

# 1. batchgen.kernels importable (the package maps kernels/ -> batchgen.kernels in pyproject.toml).
importable() { (cd /tmp && "$PY" -c "import batchgen.kernels.decode_attention, batchgen.attention") >/dev/null 2>&1; }
if importable; then
    log "batchgen already importable: $(cd /tmp && "$PY" -c 'import batchgen; print(batchgen.__file__)')"
else
    if [[ -z "${CHECK_NO_PIP:-}" ]]; then
        log "installing batchgen editable (offline, no deps)"
        timeout 45 "$PY" -m pip install --no-deps --no-build-isolation --no-index -q -e "$REPO" >>"$LOG" 2>&1
    fi
    if ! importable; then
        log "editable install unavailable: linking batchgen/kernels and batchgen/conf, PYTHONPATH=$REPO"
        [[ -e batchgen/kernels ]] || ln -s ../kernels batchgen/kernels
        [[ -e batchgen/conf ]] || ln -s ../conf batchgen/conf
        export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
if ! importable; then
    log "FATAL: cannot import batchgen.kernels"; (cd /tmp && "$PY" -c "import batchgen.kernels.decode_attention") >>"$LOG" 2>&1
    exit 3
fi

# 2. CUDA kernel tests, compiled for real (parallel workers compile in parallel when pytest-xdist is there).
XDIST=()
"$PY" -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8)
log "pytest -m gpu ${XDIST[*]} (timeout ${TEST_TIMEOUT:-150}s)"
timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -m gpu -q -rfEs -p no:cacheprovider "${XDIST[@]}" \
    --junitxml="$OUT/pytest_gpu.xml" tests/test_kernels.py tests/test_attention_e2e.py tests/test_lora_kernels.py \
    tests/test_quant_linear_triton.py >"$OUT/pytest_gpu.log" 2>&1
TEST_RC=$?
tail -n 15 "$OUT/pytest_gpu.log" | tee -a "$LOG"
log "tests exit status $TEST_RC"

# 3. Kernel benchmark.
if [[ $DRY_RUN == 1 ]]; then
    BENCH=("$PY" -m batchgen.bench.kernels --dry-run)
else
    BENCH=("$PY" -m batchgen.bench.kernels --json "$OUT/bench_kernels.json")
fi
log "${BENCH[*]} (timeout ${BENCH_TIMEOUT:-140}s)"
timeout "${BENCH_TIMEOUT:-140}" "${BENCH[@]}" >"$OUT/bench_kernels.log" 2>&1
BENCH_RC=$?
tail -n 60 "$OUT/bench_kernels.log" | tee -a "$LOG"
log "benchmark exit status $BENCH_RC"

# 4. Weight-only quantized GEMMs (int4, int8, fp8) against torch.matmul by the dequantized bfloat16 weight.
if [[ $DRY_RUN == 0 ]]; then
    # --sweep: candidate tile configurations beside the picked ones (with the grid, about 85 s on an H200)
    log "python -m batchgen.bench.quant_gemm --sweep (timeout ${QUANT_BENCH_TIMEOUT:-150}s)"
    timeout "${QUANT_BENCH_TIMEOUT:-150}" "$PY" -m batchgen.bench.quant_gemm --sweep \
        --json "$OUT/bench_quant_gemm.json" >"$OUT/bench_quant_gemm.log" 2>&1
    log "quantized GEMM benchmark exit status $?"
    tail -n 50 "$OUT/bench_quant_gemm.log" | tee -a "$LOG"
fi

log "done: tests $TEST_RC, benchmark $BENCH_RC"
[[ $TEST_RC == 0 && $BENCH_RC == 0 ]]
