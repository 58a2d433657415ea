"""Loading quantkit's C++ CPU kernels (kernels/csrc) at this process's CPU level (cpu_isa.py).

`load_cpu_extension(name, sources)` returns the module `<name>_<level>`, from the first of:
  1. the wheel: quantkit/kernels/_ext/<name>_<level>.so, built with the package (build_backend.py, cpu_build's flags), used
     when _ext/build_info.json says it was built from these sources against this torch;
  2. the build cache (a checkout, or a level the wheel lacks): built once with this machine's compiler through torch's
     extension builder into $QUANTKIT_EXT_DIR or ~/.cache/quantkit/ext, one folder per key (the sources' digest, the
     level's flags, torch's version, the interpreter, the compiler), so a shared home folder serves every CPU and
     every Python environment without rebuilding or loading another's build;
or None, and `cpu_extension_unavailable(name)` says why: callers keep their pure-torch path, so a machine without a
toolchain, or a CPU below the lowest level, loses speed, never correctness.

A build runs under an fcntl lock, which a killed process cannot keep: the next start takes the lock at once and
builds again (a build goes into a private folder and is renamed into place when complete, so nothing half-built is
ever loaded). Waiting for another process's build is said on stderr and bounded (QUANTKIT_BUILD_WAIT seconds, 900).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from quantkit.kernels import cpu_build, cpu_isa
from quantkit.kernels.cpu_build import Level

CSRC = cpu_build.CSRC
WHEEL_DIR = Path(__file__).resolve().parent / "_ext"  # what build_backend.py builds into a wheel
BUILD_INFO = "build_info.json"
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]

_failures: dict[str, str] = {}
_level_override: list[Level | None] = []  # tests only: at_level()
_resolved: dict[tuple[str, tuple[str, ...]], object] = {}  # load_cpu_extension's answers at the active level


class BuildError(RuntimeError):
    """Why an extension could not be built or had (one line: the compiler's first error, a lock, a folder)."""


@dataclass(frozen=True)
class Loaded:
    """Where a loaded extension came from, for `quantkit env`."""

    module_name: str
    origin: str  # "wheel" | "build cache" | "built now"
    path: str


_origins: dict[str, Loaded] = {}


def active_level() -> Level | None:
    """The level this process loads its kernels at (cpu_isa.selected(), or a test's at_level())."""
    return _level_override[-1] if _level_override else cpu_isa.selected().level


def level_reason() -> str:
    if _level_override:
        return "set by a test (cpu_ext.at_level)"
    return cpu_isa.selected().why


@contextlib.contextmanager
def at_level(name: str | None) -> Iterator[None]:
    """Tests: load the kernels at level `name` (None: none) within the block. Modules already built stay cached per
    level, so a model built inside the block runs that level's kernels."""
    _level_override.append(None if name is None else cpu_build.level_named(name))
    _resolved.clear()
    try:
        yield
    finally:
        _level_override.pop()
        _resolved.clear()


def build_dir() -> Path:
    env = os.environ.get("QUANTKIT_EXT_DIR")
    return Path(env) if env else Path.home() / ".cache" / "quantkit" / "ext"


def toolchain_missing() -> str | None:
    """None when a C++ compiler and ninja are on this machine, else what is missing."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def torch_version() -> str:
    """torch's version without its local tag (2.13.0+cpu and 2.13.0+cu130 share the C++ ABI of 2.13.0)."""
    import torch

    return torch.__version__.split("+")[0]


@functools.cache
def compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (out.stdout.splitlines() or ["unknown"])[0]


def cache_key(name: str, sources: tuple[str, ...], level: Level) -> str:
    """The build cache's folder for `name` at `level`: everything that makes a build differ is in its digest."""
    parts = [cpu_build.source_digest(sources, CSRC), *cpu_build.cflags(level), *cpu_build.LDFLAGS, torch_version(),
             sys.implementation.cache_tag, sys.prefix, compiler_version()]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{cpu_build.module_name(name, level.name)}-{digest}"


def import_module_file(module_name: str, path: Path):
    """Import the extension module at `path` (its init function is PyInit_<module_name>)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(path))
    spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[module_name] = module
    return module


def wheel_module(name: str, sources: tuple[str, ...], level: Level) -> tuple[Path | None, str | None]:
    """(the wheel's build of `name` at `level`, None); (None, None) where this install has none (a checkout); (None,
    why) where it has one that cannot be used here."""
    module_name = cpu_build.module_name(name, level.name)
    path = WHEEL_DIR / f"{module_name}{SUFFIX}"
    if not path.is_file():
        return None, None
    try:
        info = json.loads((WHEEL_DIR / BUILD_INFO).read_text())["modules"][module_name]
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"{BUILD_INFO} has no entry for {module_name}"
    if info.get("torch") != torch_version():
        return None, f"built for torch {info.get('torch')}, this is torch {torch_version()}"
    if CSRC.is_dir() and info.get("sources") != cpu_build.source_digest(sources, CSRC):
        return None, "built from other sources than these"
    return path, None


@contextlib.contextmanager
def holding(lock_file, what: str) -> Iterator[None]:
    """An exclusive fcntl lock on the open `lock_file` (released by the kernel when its holder dies, however it dies).
    Waiting for it is said on stderr and bounded by QUANTKIT_BUILD_WAIT seconds; past that, BuildError."""
    bound = float(os.environ.get("QUANTKIT_BUILD_WAIT", "900"))
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"quantkit: waiting for another process building {what} (at most {bound:.0f} s)", file=sys.stderr,
              flush=True)
        deadline = time.monotonic() + bound
        while True:
            time.sleep(0.2)
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"another process held the lock on {what} for {bound:.0f} s") from None
    try:
        yield
    finally:
        fcntl.flock(lock_file, fcntl.LOCK_UN)


def compile_extension(module_name: str, sources: list[Path], out: Path, level: Level, announce: str | None = None):
    """Module `module_name` built from `sources` into the folder `out` (created) at `level`'s flags through torch's
    builder, and imported; with `announce`, that line and the elapsed time show on stderr while it runs. Raises
    BuildError (one line)."""
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import load

    from quantkit.progress import elapsed

    out.mkdir(parents=True, exist_ok=True)
    # torch names a second build of one name in a process <name>_v1, ...: a file later processes could not import
    # under <name>; this build's name is always the module's own.
    getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(module_name, None)
    try:
        with elapsed(announce or "", enabled=announce is not None):
            return load(name=module_name, sources=[str(s) for s in sources], extra_cflags=cpu_build.cflags(level),
                        extra_ldflags=list(cpu_build.LDFLAGS), build_directory=str(out), verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # a compile or link error: its first error line
        lines = str(exc).strip().splitlines()
        errors = [line.strip() for line in lines if "error:" in line]
        raise BuildError(f"build failed: {(errors or lines or [type(exc).__name__])[0 if errors else -1]}") from None


def cached_module(name: str, sources: tuple[str, ...], level: Level):
    """`name` at `level` from the build cache, built first when it is not there (or when the cached file does not
    import: damaged). Raises BuildError."""
    module_name = cpu_build.module_name(name, level.name)
    root = build_dir()
    key = cache_key(name, sources, level)
    final = root / key / f"{module_name}{SUFFIX}"
    if final.is_file():
        try:
            module = import_module_file(module_name, final)
            _origins[name] = Loaded(module_name, "build cache", str(final))
            return module
        except ImportError:  # damaged: built again below, under the lock
            pass
    if (missing := toolchain_missing()) is not None:
        raise BuildError(missing)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock_file = open(root / f"{key}.lock", "a+")
    except OSError as exc:
        raise BuildError(f"the build cache {root} is not writable ({exc.strerror})") from None
    with lock_file, holding(lock_file, module_name):
        if final.is_file():  # built by another process while this one waited, or damaged
            try:
                module = import_module_file(module_name, final)
                _origins[name] = Loaded(module_name, "build cache", str(final))
                return module
            except ImportError:
                final.unlink()
        for stale in root.glob(f"{key}.tmp-*"):  # left by a killed build: nobody else holds this key's lock
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root))
        try:
            announce = f"Compiling {module_name} for this CPU (once per machine and torch)"
            module = compile_extension(module_name, [CSRC / s for s in sources], work, level, announce)
            final.parent.mkdir(exist_ok=True)
            os.replace(work / f"{module_name}.so", final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _origins[name] = Loaded(module_name, "built now", str(final))
    return module


@functools.cache
def _load(name: str, sources: tuple[str, ...], level: Level):
    """(module, None) or (None, why)."""
    module_name = cpu_build.module_name(name, level.name)
    path, not_wheel = wheel_module(name, sources, level)
    if path is not None:
        try:
            module = import_module_file(module_name, path)
            _origins[name] = Loaded(module_name, "wheel", str(path))
            return module, None
        except ImportError as exc:  # a damaged file, or a library it needs is missing
            not_wheel = f"its {path.name} does not import ({exc})"
    try:
        return cached_module(name, sources, level), None
    except (BuildError, ImportError) as exc:
        why = f"{level.name}: {exc}"
        return None, why if not_wheel is None else f"{why}; the wheel's build: {not_wheel}"


def load_cpu_extension(name: str, sources: tuple[str, ...]):
    """The compiled module `name` built from `sources` (file names under kernels/csrc) at this process's level, or
    None (then `cpu_extension_unavailable(name)` says why). Called on hot paths: after the first call, a dict
    lookup."""
    try:
        return _resolved[(name, sources)]
    except KeyError:
        module = _resolve(name, sources)
        _resolved[(name, sources)] = module
        return module


def _resolve(name: str, sources: tuple[str, ...]):
    level = active_level()
    if level is None:
        _failures[name] = f"no CPU level for the C++ kernels ({level_reason()})"
        return None
    module, why = _load(name, sources, level)
    if why is None:
        _failures.pop(name, None)
    else:
        _failures[name] = why
    return module


def cpu_extension_unavailable(name: str) -> str | None:
    """Why `load_cpu_extension(name, ...)` returned None (None if it was not tried or succeeded)."""
    return _failures.get(name)


def loaded_from(name: str) -> Loaded | None:
    return _origins.get(name)
