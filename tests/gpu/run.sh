#!/usr/bin/env bash
# GPU checks, one command (`make check-gpu`); ends with "N passed, N failed, N skipped".
#   1. every CUDA kernel against its CPU twin (tests/gpu/test_*.cu; kernels built here with
#      nvcc for sm_90 only, for speed);
#   2. the GPU model and engine (test_model_gpu.c, linked against build/libm40engine.a of
#      a CUDA-configured build): references, batched == alone, 6 concurrent requests,
#      preemption under a tiny KV pool;
#   3. `m40 eval --device 0 --tol 5e-2` for every shared model with a reference;
#      then ../shared/models/next: eval at 7.5e-2 where the architecture's GPU path is
#      validated, the clear refusal where it is not (step 3b);
#   4. the same for a synthetic Gemma 3 against tests/gemma3/ref.py (see step 4);
#   5. with 2 or more GPUs: tensor parallelism against one GPU (test_tp_gpu.c, eval --tp 2; --tp 4
#      with 4).
#   tests/gpu/run.sh            all of it
#   tests/gpu/run.sh --bench    also the GEMV microbenchmark
# Without a GPU (or nvcc): prints why and "0 passed, 0 failed, 1 skipped", exit 0.
# Needs nvcc (CUDA_DIR, default /usr/local/cuda) and a C compiler; the CPU side of the
# kernel test is compiled here directly. ARCH=... overrides the kernel test's target.
# M40_SHARED: the shared fixtures (default ../shared); M40_BIN: a prebuilt m40 and
# M40_GPU_TEST: a prebuilt test_model_gpu (used as they are when given).
set -u
cd "$(dirname "$0")/../.."
CUDA_DIR=${CUDA_DIR:-/usr/local/cuda}
NVCC=${NVCC:-$CUDA_DIR/bin/nvcc}
ARCH=${ARCH:--gencode arch=compute_90,code=sm_90}
CC=${CC:-cc}
export M40_SHARED=${M40_SHARED:-$(cd .. && pwd)/shared}
out=build/gpu
mkdir -p "$out"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
    echo "no NVIDIA GPU here: GPU checks skipped"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
passed=0 failed=0 skipped=0
# NCCL (tensor parallelism: test_tp_allreduce.cu in step 1, step 5) from the system or,
# where only PyTorch brings it, its wheel's lib folder
n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
if [ "$n_gpus" -ge 2 ] && ! ldconfig -p 2>/dev/null | grep -q libnccl.so.2; then
    for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib /usr/local/lib/python3*/dist-packages/nvidia/nccl/lib; do
        [ -f "$d/libnccl.so.2" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
    done
fi
tally() { # adds the last "N passed, N failed, N skipped" line of a log
    local line
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$1" | tail -n 1)
    if [ -z "$line" ]; then failed=$((failed + 1)); return; fi
    set -- $line
    passed=$((passed + $1)); failed=$((failed + $3))
    [ $# -ge 6 ] && skipped=$((skipped + $5))
}
log=$(mktemp -d)
# One `m40 eval --device 0` against its reference, counted: eval_one LABEL TOL MODEL REF
eval_one() {
    if "$M40_BIN" eval --device 0 --tol "$2" "$3" "$4" >"$log/eval" 2>&1; then
        passed=$((passed + 1)); echo "eval --device 0 $1: $(tail -n 1 "$log/eval")"
    else
        failed=$((failed + 1)); echo "eval --device 0 $1 FAILED:"; tail -n 20 "$log/eval"
    fi
}
trap 'rm -rf "$log"' EXIT

# 1. kernels
if [ -x "$NVCC" ]; then
    rm -f "$out/objs.txt"
    (
        set -e
        objs=()
        for f in kernels/ref/*.c; do
            o="$out/$(basename "$f" .c).o"
            $CC -std=c11 -O2 -g -D_GNU_SOURCE -Ikernels -c "$f" -o "$o"
            objs+=("$o")
        done
        pids=()
        for f in kernels/*.cu; do
            o="$out/$(basename "$f" .cu).o"
            if [ ! -f "$o" ] || [ "$f" -nt "$o" ] || [ -n "$(find kernels -maxdepth 1 -name '*.h' -newer "$o")" ]; then
                $NVCC -O3 -std=c++17 $ARCH -Ikernels -c "$f" -o "$o" &
                pids+=($!)
            fi
            objs+=("$o")
        done
        for p in "${pids[@]}"; do wait "$p"; done
        printf '%s\n' "${objs[@]}" >"$out/objs.txt"
    ) || { echo "kernels: build failed"; failed=$((failed + 1)); }
    # every tests/gpu/test_*.cu is a kernel test against the CPU twins
    if [ -f "$out/objs.txt" ]; then
        for t in tests/gpu/test_*.cu; do
            name=$(basename "$t" .cu)
            if $NVCC -O2 -std=c++17 $ARCH -Ikernels -Iengine "$t" $(cat "$out/objs.txt") -o "$out/$name" -lcublas -lm; then
                echo "== $name"; "$out/$name" "$@" 2>&1 | tee "$log/$name"; tally "$log/$name"
            else
                echo "$name: build failed"; failed=$((failed + 1))
            fi
        done
    fi
else
    echo "no nvcc at $NVCC: kernel test skipped"; skipped=$((skipped + 1))
fi

# A C test of tests/gpu against build/libm40engine.a (a CUDA-configured build): built
# unless a prebuilt binary is given, run and counted: engine_test NAME [PREBUILT]
engine_test() {
    local name=$1 bin=${2:-}
    if [ -z "$bin" ] && [ -f build/libm40engine.a ] && [ -f build/engine-libs.txt ]; then
        bin=$out/$name
        $CC -std=c11 -O2 -g -D_GNU_SOURCE -Iengine -Ikernels -Itests/unit -I"$CUDA_DIR/include" \
            $(pkg-config --cflags jansson 2>/dev/null) "tests/gpu/$name.c" build/libm40engine.a \
            $(cat build/engine-libs.txt) -o "$bin" || bin=
    fi
    if [ -n "$bin" ] && [ -x "$bin" ]; then
        echo "== $name"
        "$bin" 2>&1 | tee "$log/$name"
        tally "$log/$name"
    else
        echo "$name: no CUDA build (./configure && make), skipped"; skipped=$((skipped + 1))
    fi
}

# 2. model and engine on the GPU
M40_BIN=${M40_BIN:-build/m40}
engine_test test_model_gpu "${M40_GPU_TEST:-}"

# 2b. LongRoPE on the GPU: the CPU's equivalences (tests/unit/test_longrope.c) on device 0
lr_test=${M40_LONGROPE_TEST:-build/tests/test_longrope}
if [ -x "$lr_test" ]; then
    echo "== test_longrope --device 0"
    "$lr_test" --device 0 2>&1 | tee "$log/longrope"
    tally "$log/longrope"
else
    echo "test_longrope: not built, skipped"; skipped=$((skipped + 1))
fi

# 3. m40 eval --device 0 on every shared model with a reference
if [ -x "$M40_BIN" ] && [ -d "$M40_SHARED/models/ref" ]; then
    for ref in "$M40_SHARED"/models/ref/*.json; do
        case "$ref" in *.native.json) continue ;; esac
        name=$(basename "$ref" .json)
        model="$M40_SHARED/models/$name.gguf"
        [ -f "$model" ] || { skipped=$((skipped + 1)); continue; }
        eval_one "$name" 5e-2 "$model" "$ref"
    done
else
    echo "m40 eval --device 0: no $M40_BIN or no references, skipped"; skipped=$((skipped + 1))
fi
# 3b. ../shared/models/next: a row the architecture table (engine/model/arch.c) marks
#     gpu_validated runs `m40 eval --device 0 --tol 7.5e-2` (that folder's GPU bound);
#     a row not yet validated must be refused with "runs on the CPU only" (the second
#     list, empty while every row is validated: every row is, since session 16). To
#     validate a new one, run its evals through the test seam M40_GPU_UNVALIDATED=1 (the
#     GPU loads it anyway, logging a warning; README, tuning), set its gpu_validated and
#     move it to the first list.
if [ -x "$M40_BIN" ] && [ -d "$M40_SHARED/models/next/ref" ]; then
    for name in tiny-llama-hd-f16 tiny-qwen3-gpt2-f16 tiny-phi3-f16 tiny-gemma2-f16 \
        tiny-qwen3moe-f16 tiny-qwen3moe-q8_0 tiny-qwen3moe-q4km tiny-gpt-oss-mxfp4; do
        model="$M40_SHARED/models/next/$name.gguf" ref="$M40_SHARED/models/next/ref/$name.json"
        [ -f "$model" ] || { skipped=$((skipped + 1)); continue; }
        eval_one "next/$name" 7.5e-2 "$model" "$ref"
    done
    for name in; do
        model="$M40_SHARED/models/next/$name.gguf" ref="$M40_SHARED/models/next/ref/$name.json"
        [ -f "$model" ] || { skipped=$((skipped + 1)); continue; }
        # without the test seam, whatever the caller's environment
        if ! env -u M40_GPU_UNVALIDATED "$M40_BIN" eval --device 0 "$model" "$ref" >"$log/eval" 2>&1 &&
            grep -q "runs on the CPU only" "$log/eval"; then
            passed=$((passed + 1)); echo "eval --device 0 next/$name: refused (CPU only), as it should be"
        else
            failed=$((failed + 1)); echo "eval --device 0 next/$name was not refused:"; tail -n 20 "$log/eval"
        fi
    done
else
    echo "m40 eval --device 0 of next/: no $M40_BIN or no references, skipped"; skipped=$((skipped + 1))
fi
# 4. Gemma 3 on the GPU against the independent NumPy reference (tests/gemma3/ref.py),
#    on a small random-weight Gemma 3 built by tests/gemma3/mk_synthetic.py from the real
#    model's vocabulary (window 32, so the long prompt crosses it many times). The real
#    model itself is checked by test_model_gpu when models-cache/ holds it with its
#    reference (scripts/fetch-gemma3.sh --ref). M40_G3_SYN=DIR: a prebuilt SYN.gguf +
#    REF.json (for hosts without the Python gguf package).
syn_dir=${M40_G3_SYN:-}
if [ -z "$syn_dir" ] && [ -f models-cache/gemma-3-270m-q4_k_m.gguf ] && [ -x .venv-models/bin/python ] &&
    .venv-models/bin/python -c 'import gguf, numpy, sentencepiece' 2>/dev/null; then
    syn_dir=$out/g3syn
    mkdir -p "$syn_dir"
    .venv-models/bin/python tests/gemma3/mk_synthetic.py models-cache/gemma-3-270m-q4_k_m.gguf "$syn_dir/SYN.gguf" \
        >"$log/g3syn" 2>&1 &&
        .venv-models/bin/python tests/gemma3/ref.py "$syn_dir/SYN.gguf" "$syn_dir/REF.json" >>"$log/g3syn" 2>&1 ||
        { echo "gemma3 synthetic model: build failed"; tail -5 "$log/g3syn"; failed=$((failed + 1)); syn_dir=; }
fi
if [ -n "$syn_dir" ] && [ -x "$M40_BIN" ]; then
    eval_one "gemma3 synthetic" 5e-2 "$syn_dir/SYN.gguf" "$syn_dir/REF.json"
else
    echo "gemma3 synthetic: no models-cache/ model with .venv-models (scripts/fetch-gemma3.sh --ref) and no M40_G3_SYN, skipped"
    skipped=$((skipped + 1))
fi
# 5. tensor parallelism (hosts with 2 or more GPUs; NCCL from the system or, where only
#    PyTorch brings it, its wheel's lib folder): tp = 2 (4) against tp = 1 on synthetic
#    and shared models (test_tp_gpu.c), and `m40 eval --device 0 --tp 2` against the shared
#    references of the models that split (heads, KV heads, blocks) at the GPU's 5e-2.
if [ "$n_gpus" -ge 2 ]; then
    engine_test test_tp_gpu "${M40_TP_TEST:-}"
    if [ -x "$M40_BIN" ] && [ -d "$M40_SHARED/models/ref" ]; then
        for name in stories260K tiny-llama-spm-gqa-f16 tiny-qwen2-gpt2-f16 tiny-llama-q8_0; do
            model="$M40_SHARED/models/$name.gguf" ref="$M40_SHARED/models/ref/$name.json"
            [ -f "$model" ] || { skipped=$((skipped + 1)); continue; }
            if "$M40_BIN" eval --device 0 --tp 2 --tol 5e-2 "$model" "$ref" >"$log/eval" 2>&1; then
                passed=$((passed + 1)); echo "eval --device 0 --tp 2 $name: $(tail -n 1 "$log/eval")"
            else
                failed=$((failed + 1)); echo "eval --device 0 --tp 2 $name FAILED:"; tail -n 20 "$log/eval"
            fi
        done
        model="$M40_SHARED/models/stories260K.gguf" ref="$M40_SHARED/models/ref/stories260K.json"
        if [ "$n_gpus" -ge 4 ] && [ -f "$model" ]; then
            if "$M40_BIN" eval --device 0 --tp 4 --tol 5e-2 "$model" "$ref" >"$log/eval" 2>&1; then
                passed=$((passed + 1)); echo "eval --device 0 --tp 4 stories260K: $(tail -n 1 "$log/eval")"
            else
                failed=$((failed + 1)); echo "eval --device 0 --tp 4 stories260K FAILED:"; tail -n 20 "$log/eval"
            fi
        fi
    fi
else
    echo "tensor parallelism: $n_gpus GPU(s) here, needs 2: skipped"; skipped=$((skipped + 1))
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
