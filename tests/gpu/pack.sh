#!/usr/bin/env bash
# Packs what the GPU checks and benchmarks need into one archive for a GPU host that
# lacks the build's dependencies (no jansson, sentencepiece, nginx or compiler there):
#   tests/gpu/pack.sh [OUT.tar.xz]      (default build/gpu-pack.tar.xz)
# bin/: m40, the nginx module and the nginx it loads into (NGINX_BIN, default
# /usr/sbin/nginx), test_model_gpu, test_tp_gpu, test_longrope and the kernel tests
# (tests/gpu/test_*.cu; TESTS="test_kernels test_attn_tc" picks some, TESTS=" " none);
# lib/: the shared libraries they load, except the C runtime's and CUDA's, which the
# host has. Built for the architectures ./configure was given (--with-cuda-arch=90 for
# an H100 alone keeps it small). On the host:
#   mkdir p && tar -xJf gpu-pack.tar.xz -C p && export LD_LIBRARY_PATH=$PWD/p/lib:/usr/local/cuda/lib64
#   M40_SHARED=... p/bin/test_model_gpu; p/bin/m40 serve MODEL --device 0 --nginx p/bin/nginx
# The archive goes through xz with a dictionary larger than a binary, so the copies of
# the kernels that every binary links cost little (~5 MB for all of them at sm_90).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/gpu-pack.tar.xz}
NGINX_BIN=${NGINX_BIN:-/usr/sbin/nginx}
CUDA_DIR=${CUDA_DIR:-/usr/local/cuda}
[ -f Makefile ] || { echo "pack: run ./configure first" >&2; exit 1; }
grep -q '^HAVE_CUDA *= *yes' Makefile || { echo "pack: not a CUDA build (./configure --with-cuda)" >&2; exit 1; }
make -j"$(nproc)" all >/dev/null
gencode=$(sed -n 's/^CUDA_GENCODE *= *//p' Makefile)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
objs=$(ls build/kernels/*.o build/kernels/ref/*.o)
tests=${TESTS:-$(cd tests/gpu && ls test_*.cu | sed 's/\.cu$//')}
pids=()
for t in $tests; do
    "$CUDA_DIR/bin/nvcc" -O2 -std=c++17 $gencode -Ikernels -Iengine "tests/gpu/$t.cu" $objs \
        -o "$stage/bin/$t" -lcublas -lm &
    pids+=($!)
done
for t in test_model_gpu test_tp_gpu; do
    cc -std=c11 -O2 -g -D_GNU_SOURCE -Iengine -Ikernels -Itests/unit -I"$CUDA_DIR/include" \
        $(pkg-config --cflags jansson) "tests/gpu/$t.c" build/libm40engine.a $(cat build/engine-libs.txt) \
        -o "$stage/bin/$t"
done
for p in "${pids[@]}"; do wait "$p"; done
cp build/m40 build/ngx_http_m40_module.so build/tests/test_longrope "$stage/bin/"
[ -x "$NGINX_BIN" ] && cp "$NGINX_BIN" "$stage/bin/nginx"
strip -g "$stage"/bin/* 2>/dev/null || true
for b in "$stage"/bin/*; do ldd "$b" 2>/dev/null || true; done | awk '/=>/ {print $3}' | sort -u |
    { grep -v -E '/(libc|libm|libpthread|libdl|libresolv|librt|ld-linux|libstdc\+\+|libgcc_s|libcuda|libcublasLt|libcublas|libcudart|libnccl)[.-]' || true; } |
    while read -r l; do cp -L "$l" "$stage/lib/"; done
mkdir -p "$(dirname "$out")"
tar -C "$stage" -cf - bin lib | xz --lzma2=preset=6,dict=512MiB -T1 >"$out"
echo "pack: $out ($(du -h "$out" | cut -f1)): $(ls "$stage/bin" | tr '\n' ' ')"
