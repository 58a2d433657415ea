"""A GPTQ checkpoint made by `quantkit quantize` (stories260K, group size 64), served end to end."""

from __future__ import annotations

import pytest

from tests_support.cli import run_cli, synthetic_calib
from tests_support.serving import serve_in_thread, settings_for

pytestmark = pytest.mark.slow  # quantizes a model first


@pytest.fixture(scope="module")
def gptq_stories(stories_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gptq")
    out = tmp / "stories-gptq"
    code, output = run_cli("quantize", stories_dir, "--out", out, "--method", "gptq", "--group-size", "64",
                           "--calib", synthetic_calib(tmp / "c.txt"), "--nsamples", "8", "--seqlen", "64")
    assert code == 0, output
    return out


def test_gptq_checkpoint_serves_the_engines_greedy_tokens(gptq_stories):
    import openai

    from quantkit.engine import LLM, SamplingParams

    prompts = ["Once upon a time", "The cat"]
    ref = LLM(str(gptq_stories), num_threads=1, dtype="float32").generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    with serve_in_thread(settings_for(gptq_stories, served_model_names=("q",))) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
        for prompt, r in zip(prompts, ref):
            full = client.completions.create(model="q", prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
                                             extra_body={"return_tokens_as_token_ids": True})
            assert [int(t.split(":")[1]) for t in full.choices[0].logprobs.tokens] == r.outputs[0].token_ids
            assert full.choices[0].text == r.outputs[0].text
            stream = client.completions.create(model="q", prompt=prompt, max_tokens=16, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in stream) == full.choices[0].text
