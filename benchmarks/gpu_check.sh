#!/usr/bin/env bash
# The GPU check (issue #19): run from the repo root on a machine with an NVIDIA GPU and nvcc,
# without network, in well under 9 minutes. Writes every figure to $OUT (default ./gpu-check)
# as JSON plus a log, and prints a summary.
#
#   benchmarks/gpu_check.sh [MODEL.gguf]        # default: $GPU_CHECK_MODEL, else the demo model
#
# 1. builds the pinned llama-cpp-python from its sdist with CUDA for this GPU's architecture
#    only, on all cores (the sdist: $LLAMA_SDIST, else .whl/llama_cpp_python-*.tar.gz, else
#    pip's cache); installed into /tmp/gpu-site, first on PYTHONPATH;
# 2. runs the model tests with JUSTLLM_GPU=1 (every engine and server the tests start offloads
#    all layers: EngineConfig's default and `--gpu`'s environment variable);
# 3. runs benchmarks/engine_throughput.py --gpu at 1, 8, 32, 64 sequences, greedy with raw
#    batched llama_decode at the same shapes (the limit), sampled (temperature 0.8, top_p
#    0.95) against greedy in alternate rounds (the ratio and the per-step sampling time), the
#    context knobs --gpu's defaults are to be settled by (n_batch 2048 with n_ubatch 512 or
#    2048, flash attention auto or off: a 2048-token prefill and 32 streams each), and
#    benchmarks/spec_bench.py plain vs ngram (and draft with $GPU_CHECK_DRAFT);
# 4. prints a summary (the GPU, the build time, tests passed/failed, tok/s per level).
#
# GPU_CHECK_CPU=1 runs the same steps on a CPU machine with the installed build and small
# sizes: the way to check this script where there is no GPU.
#
# Carrying things to a machine without network (the device tool's limit is 64 MiB a call):
# pip wheels of what the machine lacks go in .whl/ (see the device README); the sdist
# (`pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d .whl`) too; the demo
# GGUF (~240 MB) must be carried in chunks over several calls into an ignored folder, or pass
# another model.
set -uo pipefail

OUT=${OUT:-./gpu-check}
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
PY=${PYTHON:-python3}
CPU_ONLY=${GPU_CHECK_CPU:-0}
START=$(date +%s)
say() { printf '\n== %s (%ds)\n' "$*" $(( $(date +%s) - START )); }
summary() { printf '%s\n' "$*" >> "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    say "installing carried wheels"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

# ---- 1. the CUDA build ------------------------------------------------------------------
if [ "$CPU_ONLY" = 1 ]; then
    say "GPU_CHECK_CPU=1: no build, the installed llama-cpp-python on the CPU"
    summary "gpu: none (GPU_CHECK_CPU=1 dry run)"
    LEVELS=1,8 TOKENS=16 TESTS="tests/engine/test_engine.py"
else
    GPU=$(nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader | head -1)
    ARCH=$(echo "$GPU" | cut -d, -f2 | tr -d ' .')
    summary "gpu: $GPU (CUDA architecture $ARCH)"
    SDIST=${LLAMA_SDIST:-$(ls .whl/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)}
    if [ -z "$SDIST" ]; then
        SDIST=$(find ~/.cache/pip -name 'llama_cpp_python-*.tar.gz' 2>/dev/null | head -1)
    fi
    [ -n "$SDIST" ] || { echo "no llama-cpp-python sdist: set LLAMA_SDIST"; exit 1; }
    say "building $SDIST with CUDA for sm_$ARCH on $(nproc) cores"
    T0=$(date +%s)
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DLLAMA_BUILD_TESTS=off" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        --target /tmp/gpu-site "$SDIST" || { echo "the CUDA build failed"; exit 1; }
    summary "build: $(( $(date +%s) - T0 )) s"
    export PYTHONPATH=/tmp/gpu-site:$PYTHONPATH
    LEVELS=1,8,32,64 TOKENS=128
    TESTS="tests/engine tests/server/test_openai_api.py tests/server/test_reliability.py"
fi
export JUSTLLM_GPU=1
[ "$CPU_ONLY" = 1 ] && export JUSTLLM_GPU=0
$PY - <<'EOF' | tee -a "$OUT/summary.txt"
from justllm.engine.backend import gpu_offload_supported
import llama_cpp
print(f"llama-cpp-python {llama_cpp.__version__}, GPU offload: {gpu_offload_supported()}")
EOF

MODEL=${1:-${GPU_CHECK_MODEL:-}}
if [ -z "$MODEL" ]; then
    MODEL=$($PY -c "from justllm.models.source import resolve_model; print(resolve_model(None))") \
        || { echo "no model: pass MODEL.gguf or set GPU_CHECK_MODEL"; exit 1; }
fi
summary "model: $MODEL"
# What --gpu's defaults come to for this model here (the KV pool from the free VRAM; a CPU
# dry run pretends 8 GiB are free).
$PY - "$MODEL" <<'EOF' | tee -a "$OUT/summary.txt"
import sys
from justllm.config import EngineConfig
from justllm.engine.backend import gpu_devices
from justllm.engine.vram import with_vram_pool
free = sum(d.free_bytes for d in gpu_devices()) or 8 * 2**30
c = with_vram_pool(EngineConfig(model=sys.argv[1], gpu=True), free_bytes=free)
print(f"--gpu defaults: n_batch {c.n_batch}, n_ubatch {c.n_ubatch}, chunk {c.chunk_size}, "
      f"KV pool {c.pool_tokens} tokens ({free / 2**30:.1f} GiB free)")
EOF

# ---- 2. the model tests on the GPU ------------------------------------------------------
say "tests with JUSTLLM_GPU=$JUSTLLM_GPU: $TESTS"
# shellcheck disable=SC2086
$PY -m pytest -q -p no:cacheprovider -x $TESTS --junitxml "$OUT/tests.xml" > "$OUT/tests.log" 2>&1
summary "tests: $(tail -1 "$OUT/tests.log")"

# ---- 3. throughput ----------------------------------------------------------------------
say "engine throughput at $LEVELS sequences"
GPU_FLAG=--gpu
[ "$CPU_ONLY" = 1 ] && GPU_FLAG=
$PY benchmarks/engine_throughput.py "$MODEL" $GPU_FLAG --levels "$LEVELS" --tokens "$TOKENS" \
    --raw --json "$OUT/engine_throughput.json" | tee "$OUT/engine_throughput.txt"
summary "engine throughput, greedy (seqs, tok/s, python share, ms/step, raw llama_decode tok/s, engine/raw):"
summary "$(tail -n +2 "$OUT/engine_throughput.txt")"
say "engine throughput sampled (temperature 0.8, top_p 0.95) vs greedy, alternate rounds"
$PY benchmarks/engine_throughput.py "$MODEL" $GPU_FLAG --levels "$LEVELS" --tokens "$TOKENS" \
    --temperature 0.8 --top-p 0.95 --vs-greedy --rounds 2 \
    --json "$OUT/engine_throughput_sampled.json" | tee "$OUT/engine_throughput_sampled.txt"
summary "engine throughput, temperature 0.8 top_p 0.95 vs greedy (tok/s, ratio, ms/step, sampling ms/step):"
summary "$(tail -n +2 "$OUT/engine_throughput_sampled.txt")"

say "context knobs: n_batch 2048, n_ubatch 512 | 2048, flash attention auto | off"
KNOB_PREFILL=2048
[ "$CPU_ONLY" = 1 ] && KNOB_PREFILL=256
for UB in 512 2048; do
    for FA in auto off; do
        $PY benchmarks/engine_throughput.py "$MODEL" $GPU_FLAG --levels 32 --tokens 32 \
            --n-batch 2048 --n-ubatch "$UB" --flash-attn "$FA" --prefill "$KNOB_PREFILL" \
            --json "$OUT/knobs_ub${UB}_fa${FA}.json" > "$OUT/knobs_ub${UB}_fa${FA}.txt" 2>&1
        summary "n_ubatch $UB flash-attn $FA: $(grep '^prefill' "$OUT/knobs_ub${UB}_fa${FA}.txt" | cut -d: -f2) prefill;$(tail -1 "$OUT/knobs_ub${UB}_fa${FA}.txt" | awk '{print " 32 streams " $2 " tok/s"}')"
    done
done

say "speculative decoding: plain vs ngram${GPU_CHECK_DRAFT:+ vs draft}"
METHODS=plain,ngram
DRAFT_ARGS=()
if [ -n "${GPU_CHECK_DRAFT:-}" ]; then METHODS=plain,ngram,draft; DRAFT_ARGS=(--draft "$GPU_CHECK_DRAFT"); fi
$PY benchmarks/spec_bench.py --model "$MODEL" --methods "$METHODS" "${DRAFT_ARGS[@]}" \
    --tokens "$TOKENS" --streams 1,8 --repeat 1 > "$OUT/spec_bench.txt" 2>&1
summary "spec bench:"
summary "$(cat "$OUT/spec_bench.txt")"

say "done"
summary "total: $(( $(date +%s) - START )) s"
printf '\n===== summary =====\n'
cat "$OUT/summary.txt"
