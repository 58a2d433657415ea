"""Engine test plumbing: one torch thread for every engine test (see tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _engine_tests_on_one_thread(one_torch_thread):
    yield
