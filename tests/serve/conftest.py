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


@pytest.fixture(scope="module")
def random_llama(stories_dir, tmp_path_factory):
    from tests_support.tool_model import make_random_llama

    return make_random_llama(tmp_path_factory.mktemp("random-llama"), stories_dir)


@pytest.fixture(scope="module")
def tools_server(random_llama):
    """The random Llama behind a server whose template writes tools, with auto tool choice on (hermes)."""
    from tests_support.tool_model import TOOLS_TEMPLATE

    settings = settings_for(random_llama, served_model_names=("tiny",), chat_template=TOOLS_TEMPLATE,
                            max_model_len=2048, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_in_thread(settings) as running:
        yield running


@pytest.fixture(scope="module")
def tools_client(tools_server):
    import openai

    return openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
