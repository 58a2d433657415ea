#!/usr/bin/env bash
# What a user installs: `pip wheel .` (the C++ kernels at every CPU level inside), installed into a fresh venv with
# its serve extra, then run from an empty folder outside the repository (.ci/wheel_check.py). WHEEL_DIR keeps the
# wheel (default: a temporary folder, removed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dist=${WHEEL_DIR:-$work/dist}
start=$SECONDS
python3 -m pip wheel -q --no-deps -w "$dist" .
wheel=$(ls "$dist"/quantkit-*.whl)
echo "wheel: $(basename "$wheel"), $(du -m "$wheel" | cut -f1) MB, built in $((SECONDS - start)) s"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q "$wheel[serve]"
mkdir "$work/empty"
cd "$work/empty"
"$work/venv/bin/python" "$repo/.ci/wheel_check.py" "$repo/../shared/data/stories260K-hf"
