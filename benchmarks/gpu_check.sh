#!/usr/bin/env bash
# The GPU check (issue #19): run from the repo root on a machine with an NVIDIA GPU and nvcc,
# without network. Writes a summary and a log to $OUT (default ./gpu-check), every figure as
# JSON and every other log in $OUT/details.tar.gz, and prints the summary.
#
#   benchmarks/gpu_check.sh [MODEL.gguf]   # default: $GPU_CHECK_MODEL, else the demo model
#   benchmarks/gpu_check.sh --stage        # only take in what this call brought (see below)
#
# Getting there: the device machine takes at most 64 MiB a call and has no network, so
# benchmarks/gpu_pack.sh packs a trimmed sdist, the wheels the image lacks and the demo model
# into .gpu/base and .gpu/part1..4, and prints six calls to make back to back. Each call's
# --stage copies what it brought into /tmp/gpu (kept while the machine stays warm); the first
# also starts the CUDA build in the background (setsid, so it outlives the call), which the
# three calls that bring the model's parts overlap; the fifth brings the last part, waits for
# the build and runs the tests (GPU_CHECK_STEPS=tests), the sixth the rest.
#
# 1. builds the pinned llama-cpp-python from its sdist with CUDA for this GPU's architecture
#    only (no llava/mtmd), on all cores, into /tmp/gpu-site, first on PYTHONPATH (the sdist:
#    /tmp/gpu, $LLAMA_SDIST, else pip's cache), and llama-server beside it;
# then the steps GPU_CHECK_STEPS names (default: all, in this order):
#   tests       model tests with JUSTLLM_GPU=1 (every engine and server the tests start
#               offloads all layers: EngineConfig's default and `--gpu`'s environment variable);
#   throughput  what --gpu's defaults come to here (the KV pool from the free VRAM), and
#               benchmarks/engine_throughput.py --gpu at 1, 8, 32, 64 sequences: greedy with
#               raw batched llama_decode at the same shapes (the limit; also with the argmax
#               taken inside the graph, so no logits come back: what reading whole rows back
#               costs; with the whole draw there: what choosing sampled tokens on the device
#               would reach), the same with the top 1024 and their probabilities taken there
#               (from the whole row, or from 1024-wide slices first) and the nucleus drawn on
#               the host (what an exact pre-selection on the device reaches), sampled (temperature 0.8, top_p 0.95) against
#               greedy in alternate rounds (the ratio and the per-step sampling time), and the
#               same with --backend-sampling (every token chosen in the graph, none read back);
#   server      justllm bench against llama-server built alongside (8 streams, greedy and
#               sampled, each order);
#   spec        benchmarks/spec_bench.py plain vs ngram vs draft vs tree (the draft:
#               $GPU_CHECK_DRAFT, else the model's first 4 layers, made by `justllm draft
#               make`; GPU_CHECK_DRAFT=none leaves draft and tree out);
#   knobs       the context knobs (n_batch 2048 with n_ubatch 512 or 2048, flash attention
#               auto or off: a 2048-token prefill and 32 streams each);
#   router      router mode with two --gpu runners of the model;
#   kvcost      what idle prefixes kept in the KV cost a decode on the GPU
#               (benchmarks/cached_kv_cost.py --gpu, 8 streams, 4k to 64k cached tokens): a
#               CPU engine keeps 64 blocks of them and moves the rest to host memory
#               (--cache-ram), a GPU engine keeps its whole pool until this is measured;
# and prints a summary (the GPU, the build time, tests passed/failed, tok/s per level).
#
# GPU_CHECK_CPU=1 runs the same steps on a CPU machine with the installed build and small
# sizes: the way to check this script where there is no GPU.
set -uo pipefail

PY=${PYTHON:-python3}
CPU_ONLY=${GPU_CHECK_CPU:-0}
GPU_DIR=${GPU_DIR:-/tmp/gpu}  # what the calls brought, kept between calls while the machine stays warm

LLAMA_SERVER_BUILD=${LLAMA_SERVER_BUILD:-/tmp/gpu-build}
gpu_arch() { nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .'; }

# --build SDIST [cpu]: the CUDA build into $GPU_SITE (/tmp/gpu-site), llama-server's in
# $LLAMA_SERVER_BUILD; its log, seconds and exit status go to $GPU_DIR/build.{log,seconds,rc}.
# ("cpu": the same build without CUDA, to check this step on a machine without a GPU.)
if [ "${1:-}" = --build ]; then
    T0=$(date +%s)
    # llama-server too, from the same build (the CUDA kernels compiled once), without its web
    # UI; it stays in the kept build folder (LLAMA_SERVER_BUILD)
    ARCH_ARGS=
    [ "${3:-}" = cpu ] || ARCH_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$(gpu_arch)"
    CMAKE_ARGS="$ARCH_ARGS -DLLAMA_BUILD_TESTS=off -DLLAVA_BUILD=off -DLLAMA_BUILD_TOOLS=on -DLLAMA_BUILD_SERVER=on -DLLAMA_BUILD_UI=off -DLLAMA_USE_PREBUILT_UI=off" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        -C build-dir="$LLAMA_SERVER_BUILD" --target "${GPU_SITE:-/tmp/gpu-site}" "$2" \
        > "$GPU_DIR/build.log" 2>&1
    RC=$?
    echo $(( $(date +%s) - T0 )) > "$GPU_DIR/build.seconds"
    echo $RC > "$GPU_DIR/build.rc"
    exit $RC
fi

# Every call: take in what it brought (gpu_pack.sh's folders), and start the build once the
# sdist is here.
mkdir -p "$GPU_DIR/whl"
for d in .gpu/*/; do
    [ -d "$d" ] || continue
    cp -n "$d"*.tar.gz "$GPU_DIR/" 2>/dev/null
    cp -n "$d"*.whl "$d"whl/*.whl "$GPU_DIR/whl/" 2>/dev/null
done
SDIST=${LLAMA_SDIST:-$(ls "$GPU_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)}
if [ -z "$SDIST" ]; then
    SDIST=$(find ~/.cache/pip -name 'llama_cpp_python-*.tar.gz' 2>/dev/null | head -1)
fi
start_build() {
    touch "$GPU_DIR/build.started"
    setsid nohup bash "$0" --build "$SDIST" > /dev/null 2>&1 < /dev/null &
}
if [ "${1:-}" = --stage ]; then
    if [ "$CPU_ONLY" != 1 ] && command -v nvidia-smi > /dev/null && [ -n "$SDIST" ] \
            && [ ! -e "$GPU_DIR/build.started" ]; then
        start_build
        echo "staged; the CUDA build of $SDIST started"
    else
        echo "staged"
    fi
    ls -la "$GPU_DIR" "$GPU_DIR/whl"
    exit 0
fi

OUT=${OUT:-./gpu-check}
# The device machine brings back at most 8 files: $OUT holds the summary, the log and every
# other file packed into details.tar.gz, packed again at each step (a run cut off by its
# time limit still brings back what it had).
D=$(mktemp -d)/details
mkdir -p "$OUT" "$D"
pack() { tar -czf "$OUT/details.tar.gz" -C "$(dirname "$D")" details; }
LOG="$OUT/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
say() { printf '\n== %s (%ds)\n' "$*" $(( $(date +%s) - START )); pack; }
summary() { printf '%s\n' "$*" >> "$OUT/summary.txt"; }
# GPU_CHECK_STEPS: which of the steps after the build to run (all by default; a device call
# has 9 minutes at most, and the build alone took 141-299 s on an H200 machine, so
# gpu_pack.sh's plan runs the tests in one call and the rest in the next)
STEPS=${GPU_CHECK_STEPS:-tests,throughput,server,spec,knobs,router,kvcost}
# GPU_CHECK_SECONDS: this call's own time (a little under the call's timeout_s): a step that
# would not fit in what is left is skipped, and saying so, and each run is cut off (SIGINT:
# pytest still writes its summary) where it would pass it, so the summary always comes back.
BUDGET=${GPU_CHECK_SECONDS:-100000}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# want STEP [SECONDS]: the step is asked for, and at least SECONDS (default 30) are left
want() {
    [[ ",$STEPS," == *",$1,"* ]] || return 1
    [ "$(left)" -ge "${2:-30}" ] && return 0
    summary "$1: skipped, $(left) s left of GPU_CHECK_SECONDS=$BUDGET"
    return 1
}
# bounded SECONDS CMD...: CMD cut off after SECONDS, or sooner where this call's time ends
bounded() {
    local n=$1; shift
    local room=$(( $(left) - 10 ))
    [ "$room" -lt "$n" ] && n=$room
    [ "$n" -ge 5 ] || { echo "(no time left for: $*)"; return 124; }
    timeout -s INT -k 15 "$n" "$@"
}
: > "$OUT/summary.txt"

if [ "$CPU_ONLY" != 1 ] && ls "$GPU_DIR"/whl/*.whl >/dev/null 2>&1; then
    say "installing the wheels brought (Python 3.12, the device image's)"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$GPU_DIR"/whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

# ---- 1. the CUDA build ------------------------------------------------------------------
if [ "$CPU_ONLY" = 1 ]; then
    say "GPU_CHECK_CPU=1: no build, the installed llama-cpp-python on the CPU"
    summary "gpu: none (GPU_CHECK_CPU=1 dry run)"
    LEVELS=1,8 TOKENS=16 TESTS="tests/engine/test_engine.py"
else
    GPU=$(nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader | head -1)
    ARCH=$(gpu_arch)
    summary "gpu: $GPU (CUDA architecture $ARCH)"
    [ -n "$SDIST" ] || { echo "no llama-cpp-python sdist: run gpu_pack.sh, or set LLAMA_SDIST"; exit 1; }
    [ -e "$GPU_DIR/build.started" ] || { say "building $SDIST with CUDA for sm_$ARCH on $(nproc) cores"; start_build; }
    say "waiting for the CUDA build"
    for _ in $(seq 480); do [ -e "$GPU_DIR/build.rc" ] || [ "$(left)" -lt 20 ] && break; sleep 1; done
    if [ "$(cat "$GPU_DIR/build.rc" 2>/dev/null)" != 0 ]; then
        tail -30 "$GPU_DIR/build.log"; echo "the CUDA build failed or did not finish"; exit 1
    fi
    summary "build: $(cat "$GPU_DIR/build.seconds") s"
    export PYTHONPATH=/tmp/gpu-site:$PYTHONPATH
    LEVELS=1,8,32,64 TOKENS=128
    TESTS="tests/engine/test_backend.py tests/engine/test_engine.py tests/engine/test_sampler.py
           tests/engine/test_prefix_cache.py tests/engine/test_kv_stress.py
           tests/engine/test_graph_sampling.py tests/server/test_openai_api.py"
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

# numpy imported before llama.cpp crashed every model load on the H200 image (2026-12-04);
# justllm/__init__.py now puts libstdc++ in the global scope first. Check both import orders
# in a process of their own, and where either still crashes, preload libstdc++ for the rest
# (the workaround seen to work there) so that the figures come anyway.
say "loading the model after numpy, both import orders"
for ORDER in "import justllm, numpy" "import numpy, justllm"; do
    if $PY -c "$ORDER
from justllm.engine.backend import BackendConfig, LlamaBackend
LlamaBackend(BackendConfig(model_path='$MODEL', n_ctx=512, gpu=$([ "$CPU_ONLY" = 1 ] && echo False || echo True))).close()" \
            > "$D/load_order.log" 2>&1; then
        summary "model load after '$ORDER': ok"
    else
        summary "model load after '$ORDER': failed (exit $?); LD_PRELOAD=libstdc++ from here on"
        tail -5 "$D/load_order.log"
        export LD_PRELOAD=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
    fi
done
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

GPU_FLAG=--gpu
[ "$CPU_ONLY" = 1 ] && GPU_FLAG=

# ---- 2. the model tests on the GPU ------------------------------------------------------
if want tests 60; then
say "tests with JUSTLLM_GPU=$JUSTLLM_GPU: $TESTS"
# (bounded: the device call has the benchmarks to run after the tests; cut off with SIGINT,
# pytest still prints what failed and writes its XML)
# shellcheck disable=SC2086
bounded "${GPU_CHECK_TEST_SECONDS:-220}" $PY -m pytest -q -rfE -p no:cacheprovider $TESTS \
    --junitxml "$D/tests.xml" > "$D/tests.log" 2>&1 || echo "pytest: exit $?" >> "$D/tests.log"
pack
summary "tests: $(grep -E '(passed|failed|error)' "$D/tests.log" | tail -1)$(grep -h '^pytest: exit' "$D/tests.log" | sed 's/^/; /')"
grep -qE '^(FAILED|ERROR) ' "$D/tests.log" && summary "$(grep -E '^(FAILED|ERROR) ' "$D/tests.log")"

fi  # tests

# ---- 3. throughput ----------------------------------------------------------------------
if want throughput 60; then
say "engine throughput at $LEVELS sequences"
bounded 150 $PY benchmarks/engine_throughput.py "$MODEL" $GPU_FLAG --levels "$LEVELS" --tokens "$TOKENS" \
    --raw --json "$D/engine_throughput.json" | tee "$D/engine_throughput.txt"
summary "engine throughput, greedy (seqs, tok/s, python share, ms/step, raw llama_decode tok/s, engine/raw, raw with the argmax in the graph tok/s, raw with the draw (temperature 0.8, top_p 0.95) in the graph tok/s):"
summary "$(tail -n +2 "$D/engine_throughput.txt")"
say "raw llama_decode with the top 1024 and their probabilities taken in the graph, the nucleus drawn on the host"
# (a run of its own, bounded: justllm's own graph sampler, built through ctypes, has not yet
# run on a GPU)
bounded 120 $PY benchmarks/engine_throughput.py "$MODEL" $GPU_FLAG --levels "$LEVELS" --tokens "$TOKENS" \
    --raw-candidates --json "$D/engine_throughput_candidates.json" | tee "$D/engine_throughput_candidates.txt"
summary "raw llama_decode, the top 1024 and their probabilities taken in the graph, the 0.95 nucleus at temperature 0.8 drawn from them on the host (tok/s, share of draws the candidates decided; cand.: from the whole row, sliced: the 64 best of each 1024-wide slice first):"
summary "$(tail -n +2 "$D/engine_throughput_candidates.txt")"
say "engine throughput sampled (temperature 0.8, top_p 0.95) vs greedy, alternate rounds"
bounded 150 $PY benchmarks/engine_throughput.py "$MODEL" $GPU_FLAG --levels "$LEVELS" --tokens "$TOKENS" \
    --temperature 0.8 --top-p 0.95 --vs-greedy --rounds 2 \
    --json "$D/engine_throughput_sampled.json" | tee "$D/engine_throughput_sampled.txt"
summary "engine throughput, temperature 0.8 top_p 0.95 vs greedy (tok/s, ratio, ms/step, sampling ms/step: all, the pooled rows' passes, their draws; greedy's):"
summary "$(tail -n +2 "$D/engine_throughput_sampled.txt")"
say "--backend-sampling: sampled vs greedy, every token chosen in the graph"
# (bounded: llama.cpp's top-p sorts every row in the graph, untimed on a GPU so far)
bounded 120 $PY benchmarks/engine_throughput.py "$MODEL" $GPU_FLAG --levels "$LEVELS" --tokens "$TOKENS" \
    --temperature 0.8 --top-p 0.95 --vs-greedy --rounds 2 --backend-sampling \
    --json "$D/engine_throughput_backend.json" | tee "$D/engine_throughput_backend.txt"
summary "--backend-sampling (tokens chosen in the graph), temperature 0.8 top_p 0.95 vs greedy (tok/s, ratio, ms/step, host choosing ms/step: all, pooled passes, draws; greedy's):"
summary "$(tail -n +2 "$D/engine_throughput_backend.txt")"

fi  # throughput

# ---- 4. against llama-server, speculation, the context knobs, router mode ----------------
if want server 90; then
say "justllm against llama-server (same build, model, GPU): 8 streams, greedy and sampled"
LLAMA_SERVER=${LLAMA_SERVER:-$(find "$LLAMA_SERVER_BUILD" -type f -name llama-server -perm -u+x 2>/dev/null | head -1)}
if [ -n "$LLAMA_SERVER" ]; then
    NGL=()
    [ "$CPU_ONLY" = 1 ] || NGL=(-ngl 999)
    "$LLAMA_SERVER" -m "$MODEL" "${NGL[@]}" -np 8 -c 8192 --port 8772 > "$D/llama_server.log" 2>&1 &
    LS_PID=$!
    $PY -m justllm serve "$MODEL" $GPU_FLAG --max-seqs 8 --port 8771 > "$D/justllm_serve.log" 2>&1 &
    JS_PID=$!
    bounded 120 $PY - <<'PYEOF'
import time, httpx
for _ in range(120):  # both up, or two minutes
    try:
        if all(httpx.get(f"http://127.0.0.1:{p}/health", timeout=2).status_code == 200
               for p in (8771, 8772)):
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
PYEOF
    N=64
    [ "$CPU_ONLY" = 1 ] && N=8
    # (justllm serve --backend-sampling is left out: on an H200 the engine chose tokens in the
    # graph more slowly than on the host, at every level; engine_throughput.py measures it)
    JS=8771
    for RUN in "greedy" "sampled --temperature 0.8 --top-p 0.95"; do
        NAME=${RUN%% *}
        # both orders: the first-measured server was favoured by up to 10% on a CPU
        for ORDER in "$JS 8772" "8772 $JS"; do
            set -- $ORDER
            bounded 60 $PY -m justllm bench --url "http://127.0.0.1:$1" --vs "http://127.0.0.1:$2" \
                -n $N -c 8 --input-len 64 --output-len 128 ${RUN#$NAME} \
                --json "$D/vs_${NAME}_$1.json" > "$D/vs_${NAME}_$1.txt" 2>&1
        done
        summary "justllm / llama-server, $NAME, output tok/s (each order): $($PY - "$JS" "$D/vs_${NAME}_$JS.json" "$D/vs_${NAME}_8772.json" <<'PYEOF'
import json, re, sys
out = []
js = sys.argv[1]
for path in sys.argv[2:]:
    try:
        runs = {re.search(r":(\d+)", r["url"]).group(1): r["output_throughput"]
                for r in json.load(open(path))}
        out.append(f"{runs[js]:.0f} / {runs['8772']:.0f} = {runs[js] / runs['8772']:.2f}x")
    except Exception as e:  # a failed run: say so in the summary
        out.append(f"failed ({type(e).__name__})")
print("; ".join(out))
PYEOF
)"
    done
    kill $LS_PID $JS_PID 2>/dev/null; wait $LS_PID $JS_PID 2>/dev/null
else
    summary "llama-server: not built (see $GPU_DIR/build.log)"
fi

fi  # server

if want spec 60; then
DRAFT=${GPU_CHECK_DRAFT:-}
if [ -z "$DRAFT" ]; then  # no small sibling offline: the model's first layers (not retrained)
    DRAFT=$GPU_DIR/draft-L4.gguf
    bounded 60 $PY -m justllm draft make "$MODEL" --layers 4 -o "$DRAFT" --force \
        > "$D/draft_make.log" 2>&1 || DRAFT=none
fi
METHODS=plain,ngram
DRAFT_ARGS=()
if [ "$DRAFT" != none ]; then METHODS=plain,ngram,draft,tree; DRAFT_ARGS=(--draft "$DRAFT"); fi
say "speculative decoding: $METHODS"
bounded 240 $PY benchmarks/spec_bench.py --model "$MODEL" --methods "$METHODS" "${DRAFT_ARGS[@]}" \
    --tokens "$TOKENS" --streams 1,8 --repeat 1 > "$D/spec_bench.txt" 2>&1
summary "spec bench:"
summary "$(cat "$D/spec_bench.txt")"

fi  # spec

if want knobs 60; then
say "context knobs: n_batch 2048, n_ubatch 512 | 2048, flash attention auto | off"
KNOB_PREFILL=2048
[ "$CPU_ONLY" = 1 ] && KNOB_PREFILL=256
for UB in 512 2048; do
    for FA in auto off; do
        bounded 60 $PY benchmarks/engine_throughput.py "$MODEL" $GPU_FLAG --levels 32 --tokens 32 \
            --n-batch 2048 --n-ubatch "$UB" --flash-attn "$FA" --prefill "$KNOB_PREFILL" \
            --json "$D/knobs_ub${UB}_fa${FA}.json" > "$D/knobs_ub${UB}_fa${FA}.txt" 2>&1
        summary "n_ubatch $UB flash-attn $FA: $(grep '^prefill' "$D/knobs_ub${UB}_fa${FA}.txt" | cut -d: -f2) prefill;$(tail -1 "$D/knobs_ub${UB}_fa${FA}.txt" | awk '{print " 32 streams " $2 " tok/s"}')"
    done
done

fi  # knobs

if want router 60; then
say "router mode: two runners of the model on one GPU (each sizes its KV pool from what the other left)"
GPU_YAML=true
[ "$CPU_ONLY" = 1 ] && GPU_YAML=false
cat > "$D/models.yaml" <<YAML
models:
  first: {source: "$MODEL", gpu: $GPU_YAML, preload: true, max-seqs: 4}
  second: {source: "$MODEL", gpu: $GPU_YAML, preload: true, max-seqs: 4}
YAML
$PY -m justllm serve --models "$D/models.yaml" --port 8773 > "$D/router.log" 2>&1 &
ROUTER_PID=$!
summary "router mode, two runners: $(bounded 120 $PY - <<'PYEOF'
import time, httpx
for _ in range(60):  # the gateway up (its runners load behind it; requests wait for them)
    try:
        httpx.get("http://127.0.0.1:8773/health", timeout=2)
        break
    except httpx.HTTPError:
        time.sleep(1)
answers = []
for name in ("first", "second"):
    try:
        r = httpx.post("http://127.0.0.1:8773/v1/completions", timeout=180, json={
            "model": name, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
        answers.append(f"{name} {r.status_code} {r.json()['choices'][0]['text']!r}"
                       if r.status_code == 200 else f"{name} {r.status_code} {r.text[:200]}")
    except httpx.HTTPError as e:
        answers.append(f"{name} {type(e).__name__}")
print(", ".join(answers))
PYEOF
)"
bounded 30 $PY -m justllm ps --url http://127.0.0.1:8773 > "$D/router_ps.txt" 2>&1
summary "$(grep -iE 'first|second' "$D/router_ps.txt" | tr -s ' ' | head -2)"
kill $ROUTER_PID 2>/dev/null; wait $ROUTER_PID 2>/dev/null

fi  # router

if want kvcost 60; then
say "idle prefixes kept in the KV: the cost per decode"
KV_CACHED=4000,16000,64000 KV_POOL=5120
[ "$CPU_ONLY" = 1 ] && KV_CACHED=500,1500 KV_POOL=256
bounded 180 $PY benchmarks/cached_kv_cost.py "$MODEL" $GPU_FLAG --streams 8 --tokens 32 --rounds 2 \
    --pool-blocks "$KV_POOL" --cached "$KV_CACHED" --json "$D/cached_kv_cost.json" \
    > "$D/cached_kv_cost.txt" 2>&1
summary "cached KV cost at 8 streams (cached tokens, tok/s with them, without, ratio):"
summary "$(cat "$D/cached_kv_cost.txt")"
fi  # kvcost
say "done"
pack && rm -rf "$(dirname "$D")"
summary "total: $(( $(date +%s) - START )) s"
printf '\n===== summary =====\n'
cat "$OUT/summary.txt"
