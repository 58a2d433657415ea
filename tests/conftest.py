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
