#!/usr/bin/env bash
# Builds the CUDA kernels and their GPU test (sm_90 only, for speed) and runs it.
#   tests/gpu/run.sh            compare every kernel with its CPU twin
#   tests/gpu/run.sh --bench    also the GEMV microbenchmark
# Needs nvcc (CUDA_DIR, default /usr/local/cuda) and a C compiler; no configure step:
# the CPU side (engine/quant.c, ggml_types.c, cpu_ref.c) is compiled here directly.
# ARCH=... overrides the target (e.g. ARCH="-gencode arch=compute_80,code=sm_80").
set -eu
cd "$(dirname "$0")/../.."
CUDA_DIR=${CUDA_DIR:-/usr/local/cuda}
NVCC=${NVCC:-$CUDA_DIR/bin/nvcc}
ARCH=${ARCH:--gencode arch=compute_90,code=sm_90}
CC=${CC:-cc}
out=build/gpu
mkdir -p "$out"
objs=()
for f in engine/quant.c engine/ggml_types.c engine/cpu_ref.c; do
    o="$out/$(basename "$f" .c).o"
    $CC -std=c11 -O2 -g -D_GNU_SOURCE -Iengine -Ikernels -c "$f" -o "$o"
    objs+=("$o")
done
pids=()
for f in kernels/*.cu; do
    o="$out/$(basename "$f" .cu).o"
    if [ ! -f "$o" ] || [ "$f" -nt "$o" ] || [ -n "$(find kernels -name '*.h' -newer "$o")" ]; then
        $NVCC -O3 -std=c++17 $ARCH -Ikernels -c "$f" -o "$o" &
        pids+=($!)
    fi
    objs+=("$o")
done
for p in "${pids[@]}"; do wait "$p"; done
$NVCC -O2 -std=c++17 $ARCH -Ikernels -Iengine tests/gpu/test_kernels.cu "${objs[@]}" -o "$out/test_kernels" -lm
exec "$out/test_kernels" "$@"
