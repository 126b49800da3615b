#!/usr/bin/env bash
# The fast CPU path's AArch64 NEON kernels (engine/model/cpu_dot_neon.c) against their
# portable twins: test_cpu_dot's kernel checks (quantizer, every type's one-token and
# piecewise kernels, the K-quants' integer extremes, axpy, GLU, the pool's matmul; not
# the model ones) cross-compiled with aarch64-linux-gnu-gcc and run under qemu-aarch64.
# Ends with "N passed, N failed, N skipped"; skips without the cross compiler or QEMU
# (Debian: gcc-aarch64-linux-gnu, qemu-user; scripts/install-deps.sh installs them).
set -u
cd "$(dirname "$0")/../.."
CC=${AARCH64_CC:-aarch64-linux-gnu-gcc}
QEMU=${QEMU_AARCH64:-qemu-aarch64}
if ! command -v "$CC" >/dev/null 2>&1 || ! command -v "$QEMU" >/dev/null 2>&1; then
    echo "no $CC or $QEMU: NEON kernels not checked"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
out=build/aarch64
mkdir -p "$out"
src="tests/unit/test_cpu_dot.c engine/model/cpu_dot.c engine/model/cpu_dot_avx2.c engine/model/cpu_dot_avx512.c
     engine/model/cpu_dot_amx.c engine/model/cpu_dot_neon.c engine/model/cpu_matmul_fast.c engine/util/threadpool.c kernels/ref/*.c"
# -static: QEMU then needs no AArch64 sysroot at run time
if ! $CC -std=c11 -O2 -D_GNU_SOURCE -DM40_CPU_DOT_ONLY -Iengine -Ikernels -Itests/unit -static $src \
    -o "$out/test_cpu_dot" -lm -lpthread 2>"$out/build.log"; then
    cat "$out/build.log"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
fi
"$QEMU" "$out/test_cpu_dot"
