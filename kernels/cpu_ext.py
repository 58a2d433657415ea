"""Building quantkit's C++ CPU kernels (kernels/csrc/*.cpp) with torch's extension builder, once per
machine, cached.

`load_cpu_extension(name, sources)` compiles with this machine's compiler (`-O3 -march=native
-fopenmp`) through `torch.utils.cpp_extension.load` into ~/.cache/quantkit/torch_extensions (or
$QUANTKIT_EXT_DIR), one folder per extension and checkout, and returns the module; torch's builder rebuilds only when a source changes and
serialises concurrent builds with a file lock. Where no compiler or ninja is found, or the build
fails, it returns None and `cpu_extension_unavailable(name)` says why: callers then keep their
pure-torch path, so a machine without a toolchain loses speed, never correctness.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
LDFLAGS = ["-fopenmp"]

_failures: dict[str, str] = {}


def build_dir() -> Path:
    env = os.environ.get("QUANTKIT_EXT_DIR")
    return Path(env) if env else Path.home() / ".cache" / "quantkit" / "torch_extensions"


def extension_dir(name: str) -> Path:
    """Where `name` is built: one folder per checkout (a digest of csrc's path). torch's builder
    rebuilds when the build file changes, and it names the sources by their paths: with one folder
    per name, two checkouts on one machine (a CI clone beside the working tree) rebuilt each
    other's kernels, ~30 s at every switch (measured as an engine start-up of 31.6 s against 0.7 s)."""
    return build_dir() / f"{name}-{hashlib.sha256(str(CSRC).encode()).hexdigest()[:8]}"


def toolchain_missing() -> str | None:
    """None when a C++ compiler and ninja are on this machine, else what is missing."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def headers_flag() -> str:
    """A define naming the digest of csrc's headers: torch's builder versions an extension by its
    sources and flags only, so a changed header must change a flag to trigger a rebuild."""
    digest = hashlib.sha256()
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return f"-DQUANTKIT_HEADERS_DIGEST={digest.hexdigest()[:16]}"


def is_built(name: str, sources: tuple[str, ...]) -> bool:
    """Whether `name` is built for this checkout and no older than its sources and csrc's headers: then a load only
    imports it; otherwise torch's builder compiles it first (36-39 s for each of the three on this project's 2-core
    machine)."""
    so = extension_dir(name) / f"{name}.so"
    if not so.is_file():
        return False
    newest = max(p.stat().st_mtime for p in [*(CSRC / s for s in sources), *CSRC.glob("*.h")])
    return so.stat().st_mtime >= newest


class BuildError(RuntimeError):
    """Why an extension did not build (the compiler's last line)."""


def compile_extension(name: str, sources: list[Path], out: Path, extra_cflags: tuple[str, ...] = (),
                      announce: str | None = None):
    """Module `name` built from `sources` into `out` with this project's flags (torch's builder: a no-op when built);
    with `announce`, that line and the elapsed time show on stderr while it runs. Raises BuildError (one line)."""
    from torch.utils.cpp_extension import load

    from quantkit.progress import elapsed

    out.mkdir(parents=True, exist_ok=True)
    try:
        with elapsed(announce or "", enabled=announce is not None):
            return load(name=name, sources=[str(s) for s in sources], extra_cflags=CFLAGS + list(extra_cflags),
                        extra_ldflags=LDFLAGS, build_directory=str(out), verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # a compile or link error
        lines = str(exc).strip().splitlines()
        raise BuildError(lines[-1] if lines else type(exc).__name__) from None


@functools.cache
def load_cpu_extension(name: str, sources: tuple[str, ...]):
    """The compiled module `name` built from `sources` (file names under kernels/csrc), or None."""
    missing = toolchain_missing()
    if missing is not None:
        _failures[name] = missing
        return None
    try:  # a first start on a machine waits for the compile: say so, with the time it takes
        announce = None if is_built(name, sources) else f"Compiling {name} for this CPU (once per checkout)"
        return compile_extension(name, [CSRC / s for s in sources], extension_dir(name), (headers_flag(),), announce)
    except BuildError as exc:  # keep the torch path
        _failures[name] = f"build failed: {exc}"
        return None


def cpu_extension_unavailable(name: str) -> str | None:
    """Why `load_cpu_extension(name, ...)` returned None (None if it was not tried or succeeded)."""
    return _failures.get(name)
