#!/usr/bin/env bash
# The whole GPU check in one prepared run (for a borrowed CUDA machine; logs and results under $OUT):
#   1. jobs/gpu/check.sh: the Triton kernels' tests compiled for real + the kernel benchmark,
#   2. the sampler's CUDA tests,
#   3. the engine check, the throughput benchmark with check=true (python -m batchgen.bench.throughput):
#      greedy equality in float32 (Triton vs torch vs transformers; exit status 1 if Triton and torch
#      disagree), the KV pool sized from engine.gpu_memory_utilization after a profiling forward (kv_sizing in
#      results), and throughput in bfloat16 against transformers generate (left-padded batches of 64) on the
#      shared-prefix and unique workloads, and vLLM when it is installed (skipped with the reason otherwise);
#      batchgen's GPU idle time per step (CUDA events around the forward vs the step's wall time, "GPU idle"
#      line of each workload's settings; gpu_idle in results.json). Results: $OUT/throughput/results.{md,json}.
# Sizes: ENGINE_ROWS (default 512) rows per workload, ENGINE_TOKENS (default 128) generated tokens per row.
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
timeout "${ENGINE_TIMEOUT:-300}" python3 -m batchgen.bench.throughput check=true device=cuda dtype=bfloat16 \
    'workloads=[shared_prefix,unique]' rows="${ENGINE_ROWS:-512}" max_tokens="${ENGINE_TOKENS:-128}" repeats=1 \
    'systems=[batchgen,hf_generate,vllm]' hf_batch_size=64 threads=4 matmul_seconds=0.1 \
    model.hidden_size=1024 model.num_layers=12 model.num_heads=16 model.num_kv_heads=4 \
    model.intermediate_size=2816 model.max_position_embeddings=4096 \
    engine.max_num_seqs=512 engine.max_num_batched_tokens=16384 engine.gpu_memory_utilization=0.85 \
    output_dir="$OUT/throughput" >"$OUT/engine_check.log" 2>&1
rc_engine=$?
tail -n 40 "$OUT/engine_check.log"
echo "kernels $rc_kernels, sampler $rc_sampler, engine $rc_engine"
[[ $rc_kernels == 0 && $rc_sampler == 0 && $rc_engine == 0 ]]
