#!/usr/bin/env bash
# Installs the Debian 12 packages m40 needs to build and test. Run as root.
# Does nothing (and needs no network) when everything is already installed.
set -euo pipefail
pkgs=(build-essential autoconf automake pkg-config
      libjansson-dev libpcre2-dev libsentencepiece-dev libcurl4-openssl-dev
      nginx-dev nginx-core curl python3 python3-venv python3-jinja2 clang
      python3-jsonschema
      chromium chromium-driver python3-selenium     # the chat page's browser test
      gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)  # the NEON kernels' check (tests/unit/neon.sh)
missing=()
for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-deps: all packages present"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps: missing packages: ${missing[*]} (run this script as root)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: installed ${missing[*]}"
