"""Schemathesis against /openapi.json: whatever it sends to /v1/completions, /v1/chat/completions and
/tokenize, the answer is 2xx or 4xx, never 5xx; the server serves normally afterwards."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests_support.live_server import assert_quiescent, stories_settings
from tests_support.serving import serve_in_thread

pytestmark = pytest.mark.slow
PATHS = r"^/(v1/completions|v1/chat/completions|tokenize)$"


def test_fuzzed_requests_never_get_a_5xx(stories_dir, tmp_path):
    pytest.importorskip("schemathesis", reason="schemathesis is a dev dependency")
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    # Short answers, few samples, a bounded queue: every request the fuzzer makes up ends within seconds.
    settings = stories_settings(stories_dir, max_num_seqs=8, max_model_len=64, max_queued_requests=16)
    with serve_in_thread(settings) as server:
        done = subprocess.run(
            [cli, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
             "--include-path-regex", PATHS, "--max-examples", "25", "--workers", "1", "--seed", "7",
             "--request-timeout", "30", "--max-time", "30", "--no-color", "--phases", "examples,coverage,fuzzing"],
            capture_output=True, text=True, timeout=150, cwd=tmp_path)
        (tmp_path / "schemathesis.txt").write_text(done.stdout + done.stderr)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        assert "Tested: 3" in done.stdout, done.stdout[-2000:]  # all three operations were fuzzed
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200
        # What the fuzzer found first: n=75635 ran for minutes. n is bounded by the engine's batch now.
        many = httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4, "n": 9})
        assert many.status_code == 400 and many.json()["error"]["param"] == "n"
        assert_quiescent(server)
