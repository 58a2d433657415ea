"""Eval tests: one torch thread (tiny models on a shared 2-core machine spend their time in
OpenMP barriers otherwise), restored afterwards; a quiet lm-eval."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    yield
    torch.set_num_threads(before)
