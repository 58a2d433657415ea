"""Fixtures for the serving tests: one shared stories260K server (in-process), the openai client."""

from __future__ import annotations

import pytest

from tests_support.serving import serve_in_thread, settings_for


@pytest.fixture(scope="module")
def stories_server(stories_dir):
    with serve_in_thread(settings_for(stories_dir, served_model_names=("stories",))) as running:
        yield running


@pytest.fixture(scope="module")
def client(stories_server):
    import openai

    return openai.OpenAI(base_url=f"{stories_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
