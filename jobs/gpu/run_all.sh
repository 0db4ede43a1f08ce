#!/usr/bin/env bash
# The whole GPU check in one prepared run (for a borrowed CUDA machine; logs under $OUT):
#   1. jobs/gpu/check.sh: the Triton kernels' tests compiled for real + the kernel benchmark,
#   2. the sampler's CUDA tests,
#   3. jobs/gpu/engine_check.py: greedy equality (Triton vs torch vs transformers), memory sizing from
#      gpu_memory_utilization, and throughput against transformers generate.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export OUT="${OUT:-$(mktemp -d /tmp/gpu_all.XXXXXX)}" PYTHONUNBUFFERED=1
TEST_TIMEOUT="${TEST_TIMEOUT:-150}" BENCH_TIMEOUT="${BENCH_TIMEOUT:-120}" bash jobs/gpu/check.sh
rc_kernels=$?
# check.sh made batchgen importable (editable install, or symlinks + this PYTHONPATH).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampler.py >"$OUT/sampler_gpu.log" 2>&1
rc_sampler=$?
tail -n 3 "$OUT/sampler_gpu.log"
timeout "${ENGINE_TIMEOUT:-200}" python3 jobs/gpu/engine_check.py >"$OUT/engine_check.log" 2>&1
rc_engine=$?
tail -n 40 "$OUT/engine_check.log"
echo "kernels $rc_kernels, sampler $rc_sampler, engine $rc_engine"
[[ $rc_kernels == 0 && $rc_sampler == 0 && $rc_engine == 0 ]]
