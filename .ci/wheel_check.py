"""What a user installs, checked from outside the repository (run by .ci/wheel_check.sh with the fresh venv's python,
in an empty folder): the installed wheel's kernels are active at this machine's level and come from the wheel,
`quantkit generate` runs on stories260K-hf, and `quantkit serve` answers one request. Exits non-zero on a failure."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
STORIES = Path(sys.argv[1]) if len(sys.argv) > 1 else None
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run(*args: str, timeout: float = 600) -> str:
    done = subprocess.run([str(BIN / "quantkit"), *args], capture_output=True, text=True, timeout=timeout, env=ENV)
    if done.returncode != 0:
        sys.exit(f"quantkit {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def check_env() -> None:
    report = json.loads(run("env", "--json"))
    assert report["cpu_level"] == report["machine_level"] != "none", report["cpu_level_why"]
    active = {k["kernel"]: k for k in report["kernels"]}
    for kernel in ("int4 linear", "bf16 linear", "paged attention", "fused ops"):
        assert active[kernel]["active"], active[kernel]
    for ext, where in report["kernel_files"].items():
        assert where.startswith("wheel: "), f"{ext}: {where}"
    print(f"env: kernels at {report['cpu_level']}, from the wheel: " +
          ", ".join(k for k, v in active.items() if v["active"]))


def check_generate() -> None:
    start = time.perf_counter()
    out = run("generate", str(STORIES), "--prompt", "Once upon a time", "--max-tokens", "16", "--temperature", "0")
    assert out.strip(), "generate printed nothing"
    print(f"generate: {time.perf_counter() - start:.1f} s from start to the last token: {out.strip()[:80]!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_serve() -> None:
    port = free_port()
    server = subprocess.Popen([str(BIN / "quantkit"), "serve", str(STORIES), "--host", "127.0.0.1", "--port", str(port),
                               "--max-model-len", "256"], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"serve did not come up: {server.stderr.read()[-3000:] if server.poll() is not None else ''}")
            time.sleep(0.5)
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"], answer
        print(f"serve: one completion: {answer['choices'][0]['text'][:60]!r}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


if __name__ == "__main__":
    check_env()
    if STORIES is None or not STORIES.is_dir():
        print(f"generate and serve: skipped, no stories260K-hf at {STORIES} (see ../shared/data/SOURCES.md)")
    else:
        check_generate()
        check_serve()
