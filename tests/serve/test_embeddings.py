"""/v1/embeddings and /v1/models/{id} on a real server, read by the official client: the vectors against transformers'
pooled final hidden state on the same tiny model (float), both encodings, text and token-id inputs, the refusals."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from tests_support.pooled_reference import pooled_reference
from tests_support.serving import serve_in_thread, settings_for

TEXTS = ["the cat sat on the mat", "a dog", "x"]
IDS = [[1, 17, 33, 250, 9], [1] + list(range(40, 90))]


def reference(model_dir, prompts: list[list[int]], pooling: str) -> np.ndarray:
    return pooled_reference(model_dir, prompts, pooling).numpy()


def text_ids(model_dir, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t).input_ids for t in texts]


@pytest.fixture(scope="module")
def tiny_server(tiny_llama):
    with serve_in_thread(settings_for(tiny_llama, served_model_names=("tiny", "tiny-alias"), max_model_len=64,
                                      max_num_batched_tokens=32)) as running:
        yield running


@pytest.fixture(scope="module")
def tiny_client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float32)


def test_text_inputs_match_transformers_in_both_encodings(tiny_client, tiny_llama):
    want = reference(tiny_llama, text_ids(tiny_llama, TEXTS), "last")
    as_float = tiny_client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    as_base64 = tiny_client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 by default
    for response in (as_float, as_base64):
        np.testing.assert_allclose(vectors(response), want, atol=2e-5, rtol=1e-4)
        assert response.model == "tiny" and response.object == "list"
        assert [d.index for d in response.data] == [0, 1, 2] and all(d.object == "embedding" for d in response.data)
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, text_ids(tiny_llama, TEXTS)))
    np.testing.assert_allclose(np.linalg.norm(vectors(as_float), axis=1), 1.0, rtol=1e-5)


def test_base64_is_little_endian_float32_of_the_float_list(tiny_server):
    def post(fmt):
        return httpx.post(f"{tiny_server.url}/v1/embeddings", json={"input": "a dog", "encoding_format": fmt},
                          timeout=60).json()["data"][0]["embedding"]

    raw = base64.b64decode(post("base64"))
    assert len(raw) == 4 * 128
    assert np.frombuffer(raw, dtype="<f4").tolist() == np.asarray(post("float"), dtype=np.float32).tolist()


@pytest.mark.parametrize("inputs", [IDS, IDS[0]], ids=["lists-of-ids", "one-list-of-ids"])
def test_token_id_inputs(tiny_client, tiny_llama, inputs):
    prompts = inputs if isinstance(inputs[0], list) else [inputs]
    got = tiny_client.embeddings.create(model="tiny-alias", input=inputs, encoding_format="float")
    np.testing.assert_allclose(vectors(got), reference(tiny_llama, prompts, "last"), atol=2e-5, rtol=1e-4)
    assert got.usage.prompt_tokens == sum(map(len, prompts)) and got.model == "tiny-alias"


def test_mean_pooling(tiny_llama):
    with serve_in_thread(settings_for(tiny_llama, pooling="mean", max_model_len=64)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.embeddings.create(model=str(tiny_llama), input=IDS)
    np.testing.assert_allclose(vectors(got), reference(tiny_llama, IDS, "mean"), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": list(range(3, 70))}, 400, "input", "maximum context length is 64 tokens"),
    ({"input": "a dog", "dimensions": 32}, 400, "dimensions", "Matryoshka"),
    ({"input": []}, 400, "input", "must not be empty"),
    ({"input": [[3, 4], [9999]]}, 400, "input", "out of vocabulary"),
    ({"input": "a dog", "encoding_format": "int8"}, 400, "encoding_format", ""),
    ({"input": "a dog", "model": "other"}, 404, "model", "does not exist"),
    ({"input": "a dog", "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens", "unknown fields are refused"),
])
def test_refusals_are_openai_errors(tiny_server, body, status, param, words):
    r = httpx.post(f"{tiny_server.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
    tiny_server.wait_idle()


def test_dimensions_of_the_models_own_size_is_accepted(tiny_client):
    got = tiny_client.embeddings.create(model="tiny", input="a dog", dimensions=128)
    assert len(got.data[0].embedding) == 128


def test_embeddings_beside_generation_leave_it_unchanged(tiny_server, tiny_client):
    """Embedding requests batched with a greedy completion: the completion is the one it is alone."""
    from concurrent.futures import ThreadPoolExecutor

    def complete():
        return tiny_client.completions.create(model="tiny", prompt=IDS[1], max_tokens=12, temperature=0).choices[0].text

    alone = complete()
    with ThreadPoolExecutor(4) as pool:
        texts = pool.submit(complete)
        embeds = [pool.submit(tiny_client.embeddings.create, model="tiny", input=IDS) for _ in range(3)]
        assert texts.result(timeout=60) == alone
        assert all(len(e.result(timeout=60).data) == 2 for e in embeds)
    tiny_server.wait_idle()


def test_model_by_id(tiny_server, tiny_client):
    card = tiny_client.models.retrieve("tiny-alias")
    assert card.id == "tiny-alias" and card.object == "model" and card.owned_by == "quantkit"
    listed = {m.id: m.model_dump() for m in tiny_client.models.list()}
    assert listed["tiny-alias"] == card.model_dump()
    with pytest.raises(openai.NotFoundError):
        tiny_client.models.retrieve("gpt-4")
    r = httpx.get(f"{tiny_server.url}/v1/models/org/gpt-4", timeout=10)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `org/gpt-4` does not exist.", "type": "not_found_error",
                                  "param": "model", "code": "model_not_found"}}
