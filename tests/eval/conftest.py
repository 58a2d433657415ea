"""Eval tests: one torch thread (tiny models on a shared 2-core machine spend their time in
OpenMP barriers otherwise), restored afterwards; a quiet lm-eval."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    yield
