"""/v1/embeddings on the wire: the request body (OpenAI's fields, vLLM's `add_special_tokens`) and the response.

`encoding_format` "base64" is what the official client asks for by default: each vector's float32 values,
little-endian, base64-encoded (the client decodes them with numpy's float32); "float" is a JSON list.
Every field of OpenAI's EmbeddingCreateParams is honoured (`user` is logged); any other field given a value is a 400
that names it, by quantkit.serve.fields as on the other endpoints (no field is silently ignored).
`dimensions` needs a Matryoshka-trained model (vLLM refuses it on any other, where cutting the vector loses what the
dropped coordinates held): it is refused unless it asks for the model's own size.
"""

from __future__ import annotations

import base64
from typing import Literal

import torch
from pydantic import Field

from quantkit.serve.errors import APIError
from quantkit.serve.protocol import OpenAIModel, Prompt

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


class EmbeddingRequest(OpenAIModel):
    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's


def check_dimensions(dimensions: int | None, hidden_size: int, model: str) -> None:
    if dimensions is not None and dimensions != hidden_size:
        raise APIError(400, f"dimensions {dimensions}: model `{model}` does not support Matryoshka representation "
                            f"(its embeddings have {hidden_size} dimensions; a shorter cut would lose what the "
                            f"dropped coordinates hold)", param="dimensions")


def check_input_length(prompts: list[list[int]], max_model_len: int) -> None:
    """400 (vLLM's wording) for an input longer than the context; 400 past MAX_INPUTS inputs."""
    if len(prompts) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(prompts)} inputs; at most {MAX_INPUTS} per request", param="input")
    for ids in prompts:
        if len(ids) > max_model_len:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                f"requested {len(ids)} tokens in the input for embedding generation. Please reduce "
                                f"the length of the input.", param="input")


def encode_vector(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """vector [hidden] fp32 -> a JSON list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def embedding_response(vectors: list[torch.Tensor], encoding_format: str, model: str, prompt_tokens: int) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
