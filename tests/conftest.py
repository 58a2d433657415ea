"""Shared fixtures: offline hub, the shared real data, and tiny random models saved to disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def shared_path(*parts: str) -> Path:
    """A path under ../shared/data, skipping the test with a clear reason when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data not found at {path} (see ../shared/data/SOURCES.md)")
    return path


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return shared_path("stories260K-hf")


@pytest.fixture(scope="session")
def wikitext_test() -> Path:
    return shared_path("wikitext2", "test.txt")


@pytest.fixture(scope="session")
def mmlu_dir() -> Path:
    return shared_path("mmlu")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from tests_support.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    from tests_support.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), family="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from tests_support.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), family="qwen3")


NEW_FAMILIES = ("phi3", "gemma3", "mixtral", "qwen3_moe", "gpt_oss")  # issue 39: every CLI path is tested on each


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """tiny_family(name) -> the folder of a tiny random model of that family (tests_support.tiny_models.FAMILIES),
    made once per session."""
    from tests_support.tiny_models import make_tiny_model

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family=family)
        return made[family]
    return get


@pytest.fixture(scope="session")
def quantized_family(tiny_family, tmp_path_factory):
    """quantized_family(family, method, layout) -> a 4-bit (group 32) checkpoint of that tiny model, made once."""
    from tests_support.int4_checkpoints import quantize_tiny

    made: dict[tuple, Path] = {}

    def get(family: str, method: str, layout: str) -> Path:
        key = (family, method, layout)
        if key not in made:
            made[key] = quantize_tiny(tiny_family(family), tmp_path_factory, method, layout, 32)
        return made[key]
    return get


def cpu_levels_here() -> list[str]:
    """The CPU levels of the C++ kernels (quantkit.kernels.cpu_build) that this machine runs, up to QUANTKIT_CPU_ISA's
    cap where it is set."""
    from quantkit.kernels import cpu_isa

    top = cpu_isa.selected().level
    if top is None:
        return []
    runnable = cpu_isa.runnable_levels(cpu_isa.cpu_flags(), cpu_isa.request_amx())
    return [lv.name for lv in runnable if runnable.index(lv) <= runnable.index(top)]


@pytest.fixture(scope="module", params=["avx2", "avx512", "avx512_bf16", "amx"])
def cpu_level(request):
    """Runs a module's tests once per CPU level of the C++ kernels (`pytestmark = pytest.mark.usefixtures(
    "cpu_level")`), so that a machine with AMX also tests the AVX-512 and AVX2 builds a user of another CPU runs.
    Levels this machine cannot execute skip with the reason. Module-scoped fixtures that hold a kernel module or a
    model must take this fixture, so that they are made again at each level."""
    from quantkit.kernels import cpu_ext

    if request.param not in (here := cpu_levels_here()):
        pytest.skip(f"this machine does not run the {request.param} level (it runs: {', '.join(here) or 'none'})")
    with cpu_ext.at_level(request.param):
        yield request.param


@pytest.fixture
def needs_bf16_dot():
    """Skips where the bf16 dot kernel (AVX-512 BF16) does not run: a CPU, or a test's CPU level, without it."""
    from quantkit.kernels import bf16_cpu

    if not bf16_cpu.bf16_dot_available():
        pytest.skip(f"the bf16 dot kernel needs AVX-512 BF16 (none at this level: {bf16_cpu.unavailable() or 'no BF16'})")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models and many small matmuls: on a shared 2-core machine torch's intra-op threads
    mostly wait on each other (13 ms against 0.2 ms per op), so such tests run on one thread,
    restored afterwards. Use it with `pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def transformers_warnings():
    """Warnings of transformers' loggers (which do not propagate to the root logger; conftest sets
    them to errors only, so warnings are switched back on here)."""
    import logging

    from transformers.utils import logging as hf_logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    hf_logging.set_verbosity(level)


@pytest.fixture(scope="session")
def gpu_device():
    """The device of the `gpu`-marked tests (`pytest -m gpu`): CUDA. Under `bash kernels/gpu_check.sh
    --dry-run` (QUANTKIT_GPU_DRY_RUN=1, TRITON_INTERPRET=1) the same tests run at toy sizes on CPU
    tensors, the kernels in Triton's interpreter, so they are known to run before a GPU is lent."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("QUANTKIT_GPU_DRY_RUN") == "1":
        pytest.importorskip("triton")
        return torch.device("cpu")
    pytest.skip("needs a CUDA device (or QUANTKIT_GPU_DRY_RUN=1 for the interpreter dry run)")
