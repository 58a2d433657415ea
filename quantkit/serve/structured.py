"""A request's structured output, under whichever name its client uses, as the engine's StructuredOutputsParams.

Names (at most one per request, else a 400): OpenAI's `response_format` (`text` asks for nothing, `json_object`,
`json_schema` with `strict` enforced either way), vLLM's `structured_outputs` ({json | regex | choice | grammar}) and
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, llama-server's `json_schema` and
`grammar`. Whether the spec compiles is the engine's to say (a 400 naming the problem, at admission).
"""

from __future__ import annotations

from collections.abc import Callable

from quantkit.engine.sampling_params import StructuredOutputsParams
from quantkit.errors import QuantkitError
from quantkit.serve.errors import APIError
from quantkit.serve.protocol import ResponseFormat, SamplingFields

VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _response_format(rf: ResponseFormat) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    return StructuredOutputsParams(json=rf.json_schema.schema_)


def _vllm(spec: dict) -> StructuredOutputsParams:
    unknown = sorted(set(spec) - set(VLLM_KEYS))
    if unknown:
        raise APIError(400, f"structured_outputs: unknown key {unknown[0]!r} (expected one of {', '.join(VLLM_KEYS)})",
                       param="structured_outputs")
    return StructuredOutputsParams(**{k: v for k, v in spec.items() if v is not None and v is not False})


# request field -> its value as a spec (None: the field asks for no constraint)
SOURCES: dict[str, Callable[[object], StructuredOutputsParams | None]] = {
    "response_format": _response_format,
    "structured_outputs": _vllm,
    "guided_json": lambda v: StructuredOutputsParams(json=v),
    "guided_regex": lambda v: StructuredOutputsParams(regex=v),
    "guided_choice": lambda v: StructuredOutputsParams(choice=v),
    "guided_grammar": lambda v: StructuredOutputsParams(grammar=v),
    "json_schema": lambda v: StructuredOutputsParams(json=v),
    "grammar": lambda v: StructuredOutputsParams(grammar=v),
}


def structured_spec(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's spec, or None; a 400 when two names are given or a value is malformed."""
    given = {name: getattr(body, name) for name in SOURCES if getattr(body, name) is not None}
    if len(given) > 1:
        raise APIError(400, f"give one structured output, not {len(given)}: {', '.join(given)}", param=list(given)[1])
    for name, value in given.items():
        try:
            return SOURCES[name](value)
        except QuantkitError as exc:
            raise APIError(400, f"{name}: {exc}", param=name) from exc
    return None
