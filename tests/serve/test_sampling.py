"""n, seeds, logprobs and exact greedy tokens through /v1/completions (stories260K)."""

from __future__ import annotations

import httpx
import pytest
import torch


def completion(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "stories", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(logprobs: dict) -> list[int]:
    return [int(t.split(":")[1]) for t in logprobs["tokens"]]


def test_greedy_tokens_equal_the_offline_engine(stories_server):
    from quantkit.engine import LLM, SamplingParams

    prompts = ["Once upon a time", "Tom had a red ball"]
    llm = LLM(stories_server.state.settings.engine.model, num_threads=1, dtype="float32")  # the server's dtype
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    for prompt, ref in zip(prompts, refs):
        body = completion(stories_server.url, prompt=prompt, max_tokens=20, temperature=0, logprobs=0,
                          return_tokens_as_token_ids=True)
        assert token_ids(body["choices"][0]["logprobs"]) == ref.outputs[0].token_ids


def test_n3_with_a_seed_is_reproducible(stories_server):
    body = dict(prompt="Once upon a time", max_tokens=16, temperature=1.0, n=3, seed=1234)
    a = completion(stories_server.url, **body)
    b = completion(stories_server.url, **body)
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len({c["text"] for c in a["choices"]}) > 1  # three different samples
    c = completion(stories_server.url, **body, logprobs=0, return_tokens_as_token_ids=True)
    assert [x["text"] for x in c["choices"]] == [x["text"] for x in a["choices"]]
    assert c["usage"]["completion_tokens"] == sum(len(x["logprobs"]["tokens"]) for x in c["choices"])


def test_n3_streams_every_index_to_the_end(stories_server):
    import openai

    client = openai.OpenAI(base_url=f"{stories_server.url}/v1", api_key="x", max_retries=0, timeout=60)
    full = client.completions.create(model="stories", prompt="Once", max_tokens=10, temperature=1.0, n=3, seed=7)
    chunks = list(client.completions.create(model="stories", prompt="Once", max_tokens=10, temperature=1.0, n=3,
                                            seed=7, stream=True))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [c.text for c in full.choices]
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finals) == [0, 1, 2]


def reference_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32: the transformers model's log-softmax after each prefix of `ids`."""
    from quantkit.model.loader import load_model

    model, _ = load_model(model_dir)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_scores(token_lp: float, top: dict[int, float], ref_row: torch.Tensor, tok: int, k: int) -> None:
    assert token_lp == pytest.approx(ref_row[tok].item(), abs=1e-3)
    best = torch.topk(ref_row, k)
    for t, v in zip(best.indices.tolist(), best.values.tolist()):
        assert top[t] == pytest.approx(v, abs=1e-3)


def test_logprobs_match_a_log_softmax_of_the_model(stories_server):
    body = completion(stories_server.url, prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=3,
                      return_tokens_as_token_ids=True)
    lp = body["choices"][0]["logprobs"]
    prompt_ids = httpx.post(f"{stories_server.url}/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    out_ids = token_ids(lp)
    logprobs = reference_logprobs(stories_server.state.settings.engine.model, prompt_ids + out_ids)
    ref = logprobs[len(prompt_ids) - 1:-1]  # [12, vocab]: the distribution of each output
    for pos, tok in enumerate(out_ids):
        got = {int(k.split(":")[1]): v for k, v in lp["top_logprobs"][pos].items()}
        assert_scores(lp["token_logprobs"][pos], got, ref[pos], tok, 3)
        assert tok == int(torch.argmax(ref[pos]))  # greedy: the sampled token is the top one


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(stories_server, client, stream):
    """vLLM's shape through the openai client: the prompt's tokens first, the first with null logprobs."""
    prompt = "Once upon a time, there was a little"
    r = client.completions.create(model="stories", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                  logprobs=2, stream=stream, extra_body={"return_tokens_as_token_ids": True})
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].text for c in chunks)
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        tokens = [t for lp in lps for t in lp.tokens]
        token_lps = [v for lp in lps for v in lp.token_logprobs]
        tops = [t for lp in lps for t in lp.top_logprobs]
    else:
        text, lp = r.choices[0].text, r.choices[0].logprobs
        tokens, token_lps, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    prompt_ids = httpx.post(f"{stories_server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    ids = [int(t.split(":")[1]) for t in tokens]
    assert text.startswith(prompt) and ids[:len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + 4
    assert token_lps[0] is None and tops[0] is None  # nothing scores the first prompt token
    ref = reference_logprobs(stories_server.state.settings.engine.model, ids)
    for pos in range(1, len(ids)):
        top = {int(k.split(":")[1]): v for k, v in tops[pos].items()}
        assert_scores(token_lps[pos], top, ref[pos - 1], ids[pos], 2)


def test_logprobs_past_20_is_400(stories_server):
    r = httpx.post(f"{stories_server.url}/v1/completions", json={"prompt": "Once", "logprobs": 21}, timeout=60)
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
