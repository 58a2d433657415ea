#!/usr/bin/env bash
# Everything that needs a GPU, in one call of at most 8 minutes; writes OUTDIR/gpu_check.md.
#   bash kernels/gpu_check.sh OUTDIR             on a machine with a CUDA GPU, torch and triton
#   bash kernels/gpu_check.sh --dry-run OUTDIR   every step at toy size on CPU (Triton interpreter)
# A thin shell over `python -m quantkit.bench.gpu_check` (see its docstring for the steps), which is the same check
# for a chosen interpreter. The interpreter: $PYTHON if set; else, in a checkout, its .venv's; else the first of
# python3 and python on PATH that imports quantkit. Where none does and this is a checkout, the checkout is installed
# into python3 first (editable; with its dependencies when the package index can be reached, else without them: a
# step whose dependency is missing then fails in the report, not here). From an installed package (this script in
# site-packages/quantkit/kernels), nothing is installed, and the GPU tests step is skipped: tests ship with the source.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
checkout=0
[ -f "$root/pyproject.toml" ] && [ -d "$root/quantkit" ] && checkout=1

imports_quantkit() {  # from another folder, so that a checkout's quantkit/ does not shadow a missing install
    (cd / && "$1" -c "import quantkit.kernels, quantkit.calibration") >/dev/null 2>&1
}

if [ -z "${PYTHON:-}" ]; then
    if [ "$checkout" = 1 ] && [ -x "$root/.venv/bin/python" ] && imports_quantkit "$root/.venv/bin/python"; then
        PYTHON="$root/.venv/bin/python"
    else
        for candidate in python3 python; do
            if command -v "$candidate" >/dev/null && imports_quantkit "$(command -v "$candidate")"; then
                PYTHON="$(command -v "$candidate")"
                break
            fi
        done
    fi
fi
if [ -z "${PYTHON:-}" ] || ! imports_quantkit "$PYTHON"; then
    PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
    if [ "$checkout" != 1 ]; then
        echo "gpu_check: $PYTHON cannot import quantkit (pip install quantkit, or set PYTHON)" >&2
        exit 2
    fi
    echo "gpu_check: installing this checkout into $PYTHON (pip install -e .)" >&2
    (cd "$root" && { "$PYTHON" -m pip install -q --retries 0 --timeout 10 -e . >&2 \
        || QUANTKIT_BUILD_KERNELS=0 "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >&2; })
fi
echo "gpu_check: $PYTHON" >&2
if [ "$checkout" = 1 ]; then cd "$root"; else cd "$(mktemp -d)"; fi
exec "$PYTHON" -m quantkit.bench.gpu_check "$@"
