"""`quantkit serve MODEL`: an OpenAI-compatible HTTP server on the paged-KV engine (vLLM's flag names)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from quantkit.commands.common import console, engine_switch, one_line_errors
from quantkit.commands.flags import argument, command, option
from quantkit.errors import QuantkitError
from quantkit.memory import bound_kernel_caches

if TYPE_CHECKING:
    from quantkit.serve.settings import ServeSettings

# oneDNN/ideep kernels kept per input shape (quantkit.memory): a server meets every token count from 1 to
# --max-num-batched-tokens; 128 entries each bound their memory at ~64 MiB instead of ~500 MiB at 1024.
KERNEL_CACHE_ENTRIES = 128


@dataclass(frozen=True)
class ServeFlags:
    """`quantkit serve`'s command line as typed (vLLM's flag names); serve_settings makes it the ServeSettings."""

    model: str = argument(..., help="Checkpoint folder (float, GPTQ, AWQ or compressed-tensors) or hub id.")
    host: str = option("127.0.0.1", "--host")
    port: int = option(8000, "--port")
    served_model_name: list[str] | None = option(None, "--served-model-name",
                                                 help="Name(s) clients use in `model` (default: MODEL).")
    api_key: list[str] | None = option(None, "--api-key",
                                       help="Accepted Bearer key(s); also QUANTKIT_API_KEY. Default: open.")
    api_keys_file: Path | None = option(
        None, "--api-keys-file", help="TOML of named keys with per-key limits (requests/tokens per minute, "
                                "concurrent requests); see the README.")
    max_model_len: int | None = option(None, "--max-model-len")
    max_num_seqs: int = option(64, "--max-num-seqs")
    max_num_batched_tokens: int = option(2048, "--max-num-batched-tokens")
    gpu_memory_utilization: float = option(0.9, "--gpu-memory-utilization")
    kv_cache_memory: str | None = option(None, "--kv-cache-memory", help="KV pool size on CPU, e.g. 512MiB.")
    swap_space: float = option(0.0, "--swap-space", help="GiB of CPU swap for preempted requests.")
    enable_prefix_caching: bool = option(True, "--enable-prefix-caching/--no-enable-prefix-caching")
    block_size: int = option(16, "--block-size")
    dtype: str = option("auto", "--dtype", help="auto, float32, bfloat16 or float16 (GPU).")
    device: str = option("auto", "--device", help="auto, cpu or cuda.")
    chat_template: Path | None = option(None, "--chat-template", help="A Jinja chat template file.")
    max_queued_requests: int | None = option(None, "--max-queued-requests",
                                             help="429 past this many waiting requests (default: unbounded).")
    shutdown_timeout: float = option(30.0, "--shutdown-timeout",
                                     help="Seconds requests in flight may take to finish on SIGTERM.")
    threads: int | None = option(None, "--threads", help="CPU threads for torch.")
    cpu_int8_activations: bool = engine_switch("cpu_int8_activations")
    cpu_int8_lm_head: bool | None = engine_switch("cpu_int8_lm_head")
    cpu_int8_prefill: bool | None = engine_switch("cpu_int8_prefill")
    cpu_huge_pages: bool = engine_switch("cpu_huge_pages")
    log_level: str = option("info", "--log-level", help="debug, info, warning or error.")
    enable_auto_tool_choice: bool = option(False, "--enable-auto-tool-choice",
                                           help='tool_choice "auto": parse tool calls out of the output.')
    tool_call_parser: str | None = option(None, "--tool-call-parser",
                                          help="The format the model writes calls in: hermes, llama3_json or "
                                               "mistral.")
    engine_name: str = option("quantkit", "--engine", help="quantkit (this engine, one device) or vllm "
                              "(hand the same flags to `vllm serve`, for tensor/pipeline parallelism).")
    tensor_parallel_size: int = option(1, "--tensor-parallel-size", "-tp", min=1, help="GPUs per model copy (--engine vllm).")
    pipeline_parallel_size: int = option(1, "--pipeline-parallel-size", "-pp", min=1, help="Pipeline stages (--engine vllm).")
    vllm_executable: str | None = option(None, "--vllm-executable", help="The `vllm` to run, or the python of "
                                         "a venv with vLLM (the CPU build's way in); default: `vllm` on PATH, "
                                         "or this Python's.")
    tokenizer: str | None = option(None, "--tokenizer", help="A tokenizer folder or hub id other than MODEL's "
                                   "(its chat template too).")
    seed: int | None = option(None, "--seed", help="The seed of requests that give none: such a request samples "
                              "as if it had sent this seed (reproducible). Default: a fresh draw per request.")
    max_logprobs: int = option(20, "--max-logprobs", help="The most logprobs / top_logprobs a request may ask "
                               "for (400 above it); -1: the vocabulary.")
    pooling: str = option("last", "--pooling", help="/v1/embeddings: the final hidden state of the last token "
                          "(vLLM's default for a generative model) or the mean over the input; L2-normalized.")
    speculative_config: str | None = option(
        None, "--speculative-config", help="vLLM's JSON, n-gram prompt lookup: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'; its counters in /metrics (vllm:spec_decode_*).")
    allowed_origins: str | None = option(None, "--allowed-origins", help='CORS: a JSON list of origins '
                                         '(default ["*"], as vLLM).')
    allowed_methods: str | None = option(None, "--allowed-methods", help='CORS: a JSON list (default ["*"]).')
    allowed_headers: str | None = option(None, "--allowed-headers", help='CORS: a JSON list (default ["*"]).')
    allow_credentials: bool = option(False, "--allow-credentials", help="CORS: allow cookies and auth headers.")
    root_path: str = option("", "--root-path", help="The path prefix a proxy serves this server under (the "
                            "proxy strips it), e.g. /llm.")
    uds: Path | None = option(None, "--uds", help="Listen on this Unix socket instead of --host/--port.")


def register(app: typer.Typer) -> None:
    # extra arguments: what follows `--`, handed to vLLM with --engine vllm
    app.command("serve", context_settings={"allow_extra_args": True})(command(ServeFlags, serve))


def api_keys(given: list[str] | None) -> tuple[str, ...]:
    keys = list(given or [])
    if not keys and os.environ.get("QUANTKIT_API_KEY"):
        keys = [os.environ["QUANTKIT_API_KEY"]]
    return tuple(keys)


def serve_settings(flags: ServeFlags) -> ServeSettings:
    """The one validated ServeSettings of the flags (a bad value is a one-line QuantkitError)."""
    from quantkit.commands.generate import parse_json_option, parse_size
    from quantkit.engine.config import EngineConfig
    from quantkit.serve.settings import ANY, ServeSettings, json_list, read_chat_template

    f = flags
    if f.log_level not in ("debug", "info", "warning", "error"):
        raise QuantkitError(f"--log-level {f.log_level!r}: expected debug, info, warning or error")
    engine = EngineConfig(model=f.model, max_num_seqs=f.max_num_seqs, max_model_len=f.max_model_len,
                          max_num_batched_tokens=f.max_num_batched_tokens, block_size=f.block_size,
                          enable_prefix_caching=f.enable_prefix_caching,
                          gpu_memory_utilization=f.gpu_memory_utilization,
                          kv_cache_memory=None if f.kv_cache_memory is None else parse_size(f.kv_cache_memory),
                          swap_space=f.swap_space, dtype=f.dtype, device=f.device, num_threads=f.threads,
                          cpu_int8_activations=f.cpu_int8_activations, cpu_int8_lm_head=f.cpu_int8_lm_head,
                          cpu_int8_prefill=f.cpu_int8_prefill, cpu_huge_pages=f.cpu_huge_pages,
                          tokenizer=f.tokenizer, max_logprobs=f.max_logprobs,
                          speculative_config=parse_json_option(f.speculative_config, "--speculative-config"))
    cors = {name: json_list(getattr(f, name), "--" + name.replace("_", "-")) or ANY
            for name in ("allowed_origins", "allowed_methods", "allowed_headers")}
    return ServeSettings(engine, host=f.host, port=f.port, served_model_names=tuple(f.served_model_name or ()),
                         api_keys=api_keys(f.api_key), api_keys_file=f.api_keys_file,
                         chat_template=read_chat_template(f.chat_template), max_queued_requests=f.max_queued_requests,
                         shutdown_timeout=f.shutdown_timeout, log_level=f.log_level,
                         enable_auto_tool_choice=f.enable_auto_tool_choice, tool_call_parser=f.tool_call_parser,
                         pooling=f.pooling, seed=f.seed, allow_credentials=f.allow_credentials,
                         root_path=f.root_path, uds=f.uds, **cors)


@one_line_errors
def serve(ctx: typer.Context, flags: ServeFlags) -> None:
    """Serve MODEL over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/embeddings, streaming) until
    SIGTERM. With --engine vllm, arguments after `--` go to vLLM as they are."""
    from quantkit.model.checkpoint import check_model_reference
    from quantkit.serve.runner import serve_until_stopped

    f = flags
    settings = serve_settings(f)
    if f.engine_name == "vllm":
        _hand_to_vllm(settings, f.tensor_parallel_size, f.pipeline_parallel_size, f.chat_template, f.vllm_executable,
                      ctx.args)
        return
    if f.engine_name != "quantkit":
        raise QuantkitError(f"--engine {f.engine_name!r}: expected quantkit or vllm")
    if ctx.args:
        raise QuantkitError(f"unexpected arguments {' '.join(ctx.args)}: what follows `--` goes to vLLM, with "
                            "--engine vllm only")
    if f.tensor_parallel_size > 1 or f.pipeline_parallel_size > 1:
        raise QuantkitError("quantkit's engine runs on one device: use --engine vllm for --tensor-parallel-size "
                            "or --pipeline-parallel-size above 1")
    check_model_reference(f.model)  # a path that is not there: one line now, not a traceback from the engine thread
    tokenizer = None if f.tokenizer is None else Path(f.tokenizer).expanduser()
    if tokenizer is not None and tokenizer.exists() and not tokenizer.is_dir():
        raise QuantkitError(f"--tokenizer {f.tokenizer}: not a folder (expected a tokenizer's folder or a hub id)")
    logging.basicConfig(level=f.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    bound_kernel_caches(KERNEL_CACHE_ENTRIES)  # before the model runs: RSS stays flat under traffic
    failure = serve_until_stopped(settings, say=lambda line: console.print(line, highlight=False, soft_wrap=True))
    if failure:
        raise QuantkitError(f"the model failed to load: {failure}")


def _hand_to_vllm(settings, tp: int, pp: int, chat_template: Path | None, executable: str | None,
                  passthrough: list[str]) -> None:
    from quantkit.serve.vllm_handoff import exec_vllm, vllm_command, vllm_serve_args

    vllm = vllm_command(executable)
    handoff = vllm_serve_args(settings, tp, pp, chat_template, passthrough)
    for note in handoff.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    console.print(f"handing over to: {' '.join([*vllm, *handoff.argv[:1]])} ...", highlight=False, soft_wrap=True)
    exec_vllm(vllm, handoff)
