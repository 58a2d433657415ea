#!/usr/bin/env bash
# Everything that needs a GPU, in one call of at most 8 minutes; writes OUTDIR/gpu_check.md.
#   bash kernels/gpu_check.sh OUTDIR             on a machine with a CUDA GPU, torch and triton
#   bash kernels/gpu_check.sh --dry-run OUTDIR   every step at toy size on CPU (Triton interpreter)
# A thin shell over `python -m quantkit.bench.gpu_check` (see its docstring for the steps). When
# quantkit is not importable, this checkout is installed first (editable; with its dependencies when
# the package index can be reached, else without them: a step whose dependency is missing then
# fails in the report, not here). PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
# From another folder, so that this checkout's quantkit/ does not shadow a missing install:
# quantkit.kernels and quantkit.calibration only exist through the install's package-dir mapping.
if ! (cd / && "$PYTHON" -c "import quantkit.kernels, quantkit.calibration") >/dev/null 2>&1; then
    echo "gpu_check: installing this checkout (pip install -e .)" >&2
    "$PYTHON" -m pip install -q --retries 0 --timeout 10 -e . >&2 \
        || "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >&2
fi
exec "$PYTHON" -m quantkit.bench.gpu_check "$@"
