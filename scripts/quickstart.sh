#!/usr/bin/env bash
# First command of the README: install the build dependencies, build, and run the
# main job. Re-running is cheap (nothing is reinstalled or rebuilt when up to date).
#   M40_MODEL=/path/to/model.gguf scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
[ -f Makefile ] && [ Makefile -nt Makefile.in ] && [ Makefile -nt configure ] || ./configure
make -j"$(nproc)"

model=${M40_MODEL:-}
if [ -z "$model" ] && [ -f ../shared/models/aidreams260K.gguf ]; then
    model=../shared/models/aidreams260K.gguf
fi
if [ -z "$model" ]; then
    echo "quickstart: set M40_MODEL=/path/to/model.gguf" >&2
    exit 2
fi
exec build/m40 run "$model" -p "${M40_PROMPT:-Once upon a time}" --temp 0 -n 128
