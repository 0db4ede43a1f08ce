#!/usr/bin/env bash
# The whole GPU check in one prepared run (for a borrowed CUDA machine; logs and results under $OUT):
#   1. jobs/gpu/check.sh: the Triton kernels' tests compiled for real + the kernel benchmark + the weight-only
#      GEMM benchmark with its tile sweep,
#   2. the sampler's CUDA tests, then jobs/gpu/features_check.py: each engine feature on CUDA against the CPU
#      (greedy tokens of text, n > 1 prefix sharing, LoRA, images, GPTQ / fp8 / GGUF weights; embeddings; fp8 KV
#      agreement; $OUT/features.log),
#   3. the engine check, the throughput benchmark with check=true (python -m batchgen.bench.throughput):
#      greedy equality in float32 (Triton vs torch vs transformers; exit status 1 if Triton and torch
#      disagree), the KV pool sized from engine.gpu_memory_utilization after a profiling forward (kv_sizing in
#      results), and the table of the CPU runs (ENGINE_WORKLOADS, default shared_prefix,unique; add long_tail
#      when the lease has room) in bfloat16: batchgen, transformers generate (left-padded batches of 64) and vLLM's CUDA
#      build when an interpreter has it (VLLM_PYTHON, else python3 if it imports vllm, else ~/.venvs/vllm/bin/python;
#      skipped with the reason otherwise). GPU idle time: batchgen's per step (CUDA events around the forward
#      vs the step's wall time, "GPU idle" line of each workload's settings; gpu_idle in results.json), and for
#      the whole run the device's utilisation sampled by nvidia-smi every 200 ms ($OUT/gpu_util.csv, with each
#      system's run window in results.json: started_at + subprocess_seconds; summary in gpu_util_summary.txt).
#      Results: $OUT/throughput/results.{md,json}. On the GPU each system runs its repeats in one process
#      (alternate=false: one vLLM start per workload, CUDA graphs and torch.compile on, as users run it).
#   4. batchgen alone again with engine.async_scheduling=true on shared_prefix and unique ($OUT/async_check.log).
# Every step fails soft: a missing tool or a failed step is logged and the next step still runs; the exit status
# says whether the first three passed (the features check included).
# Sizes: ENGINE_ROWS (default 256) rows per workload, ENGINE_TOKENS (default 128) generated tokens per row,
# ENGINE_REPEATS (default 1). The defaults fit a 10-minute command on an H200 with time to spare (measured:
# kernels and sampler about 2.5 minutes, the engine check on two workloads about 2); transformers' long_tail run
# (every row of a left-padded batch runs to the batch's longest output) took over 110 s alone, so long_tail is
# left to ENGINE_WORKLOADS=shared_prefix,unique,long_tail.
#
# From a borrowed machine whose image lacks Hydra (carry the wheels of hydra-core, omegaconf and
# antlr4-python3-runtime in an ignored .whl/ folder, and gguf's for the GGUF feature), with every log coming back
# as one archive:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   R=$OUT; OUT=/tmp/g timeout 560 bash jobs/gpu/run_all.sh; tar czf "$R/all.tgz" -C /tmp g
#
# What to measure first when a device is lent (every CUDA path is unmeasured so far), in this order:
#   a. the greedy check line of $OUT/engine_check.log (Triton == torch; then vs transformers),
#   b. batchgen's GPU idle fraction per step on the three workloads (the "GPU idle" lines): on a GPU the
#      engine's Python between forwards is the first suspect; if idle > ~20% of decode steps, profile the step,
#   c. batchgen ÷ vllm per workload in results.md (our ratio on the long tail and unique prompts first), and
#      async_check.log's idle lines against engine_check.log's,
#   d. the KV pool vLLM and batchgen each got (kv_sizing vs vLLM's settings line) before reading any ratio.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export OUT="${OUT:-$(mktemp -d /tmp/gpu_all.XXXXXX)}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
TEST_TIMEOUT="${TEST_TIMEOUT:-120}" BENCH_TIMEOUT="${BENCH_TIMEOUT:-70}" bash jobs/gpu/check.sh
rc_kernels=$?
# check.sh made batchgen importable (editable install, or symlinks + this PYTHONPATH).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampler.py >"$OUT/sampler_gpu.log" 2>&1
rc_sampler=$?
tail -n 3 "$OUT/sampler_gpu.log"
# 2b. Each engine feature on CUDA against the CPU, float32, on tiny checkpoints (text, prefix sharing with n > 1,
#     LoRA, images, embeddings, the fp8 KV cache): one line each.
timeout "${FEATURES_TIMEOUT:-120}" python3 jobs/gpu/features_check.py --device cuda >"$OUT/features.log" 2>&1
rc_features=$?
grep -v -E "^\s|Traceback|^[A-Za-z]+Error" "$OUT/features.log" | tail -n 8

# vLLM's CUDA build: its own interpreter (it pins its own torch), found without importing it into ours.
VLLM_PY="${VLLM_PYTHON:-}"
if [[ -z "$VLLM_PY" ]]; then
    if timeout 120 python3 -c 'import vllm' >/dev/null 2>&1; then
        VLLM_PY="$(command -v python3)"
    elif [[ -x "$HOME/.venvs/vllm/bin/python" ]]; then
        VLLM_PY="$HOME/.venvs/vllm/bin/python"
    else
        VLLM_PY="$HOME/.venvs/vllm/bin/python"  # missing: the benchmark skips vllm and says why
        echo "vLLM: no interpreter with vllm found (set VLLM_PYTHON); the table will show it skipped"
    fi
fi
echo "vLLM interpreter: $VLLM_PY"

# GPU utilisation of the whole benchmark, every system included (fails soft without nvidia-smi).
SMI_PID=""
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200 \
        >"$OUT/gpu_util.csv" 2>/dev/null &
    SMI_PID=$!
fi
# The model and engine both runs use (bfloat16 random Llama of 144M parameters; pool from the device's memory).
SHAPE=(hf_batch_size=64 threads=4 matmul_seconds=0.1
    model.hidden_size=1024 model.num_layers=12 model.num_heads=16 model.num_kv_heads=4
    model.intermediate_size=2816 model.max_position_embeddings=4096
    engine.max_num_seqs=512 engine.max_num_batched_tokens=16384 engine.gpu_memory_utilization=0.85)
ROWS="${ENGINE_ROWS:-256}" TOKENS="${ENGINE_TOKENS:-128}"
timeout "${ENGINE_TIMEOUT:-240}" python3 -m batchgen.bench.throughput check=true device=cuda dtype=bfloat16 \
    "workloads=[${ENGINE_WORKLOADS:-shared_prefix,unique}]" rows="$ROWS" max_tokens="$TOKENS" \
    repeats="${ENGINE_REPEATS:-1}" alternate=false 'systems=[batchgen,hf_generate,vllm]' "python.vllm=$VLLM_PY" \
    vllm_enforce_eager=false "${SHAPE[@]}" output_dir="$OUT/throughput" >"$OUT/engine_check.log" 2>&1
rc_engine=$?
tail -n 60 "$OUT/engine_check.log"
# 4. The same batchgen runs with engine.async_scheduling=true (the host plans step n+1 while the device runs
#    step n): compare its "GPU idle per step" lines and wall times with engine_check.log's.
timeout "${ASYNC_TIMEOUT:-100}" python3 -m batchgen.bench.throughput device=cuda dtype=bfloat16 \
    'workloads=[shared_prefix,unique]' rows="$ROWS" max_tokens="$TOKENS" repeats=1 alternate=false \
    'systems=[batchgen]' engine.async_scheduling=true "${SHAPE[@]}" output_dir="$OUT/throughput_async" \
    >"$OUT/async_check.log" 2>&1
rc_async=$?
[[ -n "$SMI_PID" ]] && kill "$SMI_PID" 2>/dev/null
grep -E "^== |batchgen +ok|GPU idle" "$OUT/async_check.log" "$OUT/throughput_async/results.md" 2>/dev/null
# Device utilisation over the whole run (per system: cut gpu_util.csv at each run's started_at in results.json).
if [[ -s "$OUT/gpu_util.csv" ]]; then
    awk -F', ' '{n++; s+=$2; if ($2 < 5) idle++} END {if (n) printf "nvidia-smi samples %d: mean utilisation %.0f%%, samples under 5%%: %.0f%%\n", n, s/n, 100*idle/n}' \
        "$OUT/gpu_util.csv" | tee "$OUT/gpu_util_summary.txt"
fi
echo "kernels $rc_kernels, sampler $rc_sampler, features $rc_features, engine $rc_engine, async $rc_async"
[[ $rc_kernels == 0 && $rc_sampler == 0 && $rc_features == 0 && $rc_engine == 0 ]]
