"""quantkit's build backend (PEP 517): setuptools' own, plus the C++ CPU kernels in every wheel.

pyproject.toml names it (`build-backend`, with `backend-path = ["kernels"]`), so the project needs no setup.py. A
wheel (`pip wheel .`, `python -m build`) carries every extension of cpu_build.py at every CPU level, so that `pip
install quantkit` needs no compiler and the import picks the highest level the CPU runs (cpu_isa.py). They are
built against the torch of the build environment: `pip wheel .` installs the torch pinned in TORCH_BUILD_REQUIRES into
an isolated one, `pip wheel --no-build-isolation .` uses the torch installed beside pip; either way the torch is
recorded in quantkit/kernels/_ext/build_info.json and checked at load. The kernels are optional: with no compiler, no
torch, off x86-64 Linux, or QUANTKIT_BUILD_KERNELS=0, the wheel builds without them and quantkit runs on torch's ops
(or compiles a kernel on first use where a compiler appears). Editable installs and sdists build nothing here: a
checkout compiles each kernel on first use, into the build cache, as its sources change.

setuptools runs a project's setup script in `run_setup`; this backend runs `setup(**options())` there instead.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.build_meta import _BuildMetaBackend

import cpu_build  # kernels/cpu_build.py: backend-path puts kernels/ on sys.path while building

TORCH_BUILD_REQUIRES = ["torch==2.13.0", "ninja>=1.11"]  # the torch a wheel's kernels are compiled against
EXT_PACKAGE = "quantkit.kernels._ext"


def why_no_kernels() -> str | None:
    """None when the kernels are to be built, else why not."""
    if os.environ.get("QUANTKIT_BUILD_KERNELS", "1") == "0":
        return "QUANTKIT_BUILD_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the C++ kernels are x86-64 Linux only (this is {platform.system()} {platform.machine()})"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed in the build environment"
    if shutil.which(cxx := os.environ.get("CXX", "c++")) is None:
        return f"no C++ compiler ({cxx}) on PATH"
    return None


def kernel_extensions() -> list:
    from torch.utils.cpp_extension import CppExtension

    csrc = Path("kernels") / "csrc"  # relative: setuptools wants sources relative to the project
    return [
        CppExtension(f"{EXT_PACKAGE}.{cpu_build.module_name(ext.name, level.name)}",
                     [str(csrc / s) for s in ext.sources], extra_compile_args=cpu_build.cflags(level),
                     extra_link_args=list(cpu_build.LDFLAGS))
        for ext in cpu_build.EXTENSIONS for level in cpu_build.LEVELS
    ]


def build_ext_command():
    from torch.utils.cpp_extension import BuildExtension

    class BuildKernels(BuildExtension):
        """torch's builder, one extension at a time with one compiler per core, then build_info.json beside the
        modules."""

        def finalize_options(self):
            super().finalize_options()
            # One extension at a time: every level of an extension compiles the same sources into the same object
            # files and build.ninja under build_temp, so two levels built at once overwrite each other's objects (a
            # wheel's quantkit_int4_avx512_bf16 was linked from another level's int4_cpu.o: no PyInit of its name).
            # Built in turn, ninja recompiles each object for the next level (its command line changed).
            self.parallel = 1
            os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))  # an extension's files fill the cores

        def run(self):
            if getattr(self, "editable_mode", False) or self.inplace:
                return  # a checkout compiles on first use
            super().run()
            self.write_build_info()

        def build_extension(self, ext):
            """One module; where it fails (an old compiler without a level's flags, say) the wheel goes on without it
            and that level keeps torch's ops (torch's builder raises RuntimeError, which setuptools' `optional` does
            not catch)."""
            try:
                super().build_extension(ext)
            except (RuntimeError, OSError) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                print(f"quantkit: {ext.name} not built ({first})", file=sys.stderr)

        def write_build_info(self):
            import torch

            out = Path(self.build_lib) / EXT_PACKAGE.replace(".", "/")
            csrc = Path(__file__).resolve().parent / "csrc"
            modules = {}
            for ext in cpu_build.EXTENSIONS:
                digest = cpu_build.source_digest(ext.sources, csrc)
                for level in cpu_build.LEVELS:
                    name = cpu_build.module_name(ext.name, level.name)
                    if any(out.glob(f"{name}.*so")):
                        modules[name] = {"extension": ext.name, "level": level.name, "sources": digest,
                                         "torch": torch.__version__.split("+")[0], "cflags": cpu_build.cflags(level)}
            missing = len(cpu_build.EXTENSIONS) * len(cpu_build.LEVELS) - len(modules)
            if missing:
                print(f"quantkit: {missing} kernel builds failed; those levels run on torch's ops", file=sys.stderr)
            out.mkdir(parents=True, exist_ok=True)
            (out / "build_info.json").write_text(json.dumps({"modules": modules}, indent=1) + "\n")

    return BuildKernels


def options() -> dict:
    if (why := why_no_kernels()) is not None:
        print(f"quantkit: no C++ kernels in this build: {why}", file=sys.stderr)
        return {}
    return {"ext_modules": kernel_extensions(), "cmdclass": {"build_ext": build_ext_command()}}


class _Backend(_BuildMetaBackend):
    def run_setup(self, setup_script: str = "setup.py") -> None:
        setup(**options())

    def get_requires_for_build_wheel(self, config_settings=None):
        return [*super().get_requires_for_build_wheel(config_settings), *TORCH_BUILD_REQUIRES]


_BACKEND = _Backend()
get_requires_for_build_wheel = _BACKEND.get_requires_for_build_wheel
get_requires_for_build_sdist = _BACKEND.get_requires_for_build_sdist
prepare_metadata_for_build_wheel = _BACKEND.prepare_metadata_for_build_wheel
build_wheel = _BACKEND.build_wheel
build_sdist = _BACKEND.build_sdist
get_requires_for_build_editable = _BACKEND.get_requires_for_build_editable
prepare_metadata_for_build_editable = _BACKEND.prepare_metadata_for_build_editable
build_editable = _BACKEND.build_editable
