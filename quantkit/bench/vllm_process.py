"""vLLM's CPU build in a subprocess of its own venv, for `quantkit bench engine --against-vllm VENV`.

The subprocess runs quantkit/bench/vllm_worker.py (standard library and vLLM only): it loads the model once, then
answers one JSON line per job. Its stderr, and the lines vLLM logs to stdout, go to a log file, from which the
kernels vLLM picked and, when it exits, its last error line are read.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path


class VLLM:
    """vLLM in a subprocess of its own venv, fed one JSON job per line."""

    def __init__(self, venv: Path, model: Path, dtype: str, threads: int, log: Path, max_model_len: int,
                 speculative_config: dict | None = None):
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2",
                   HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        model = model.resolve()  # the worker runs in the model's parent folder
        args = json.dumps(dict(model=str(model), dtype=dtype, max_model_len=max_model_len, max_num_seqs=64,
                               speculative_config=speculative_config))
        self.log = log.resolve()
        log.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        self.log_file = log.open("w")  # vLLM's stderr, and its stdout's lines other than the worker's answers
        self.proc = subprocess.Popen([str(venv / "bin" / "python"), str(Path(__file__).with_name("vllm_worker.py")),
                                      args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file,
                                     env=env, text=True, cwd=model.parent)  # not the repo root: its
        # kernels/ folder would shadow a `kernels` package vLLM imports
        try:
            if "ready" not in self._answer():
                raise RuntimeError(f"vLLM did not start; see {log}")
        except RuntimeError:
            self.proc.kill()
            self.proc.wait(timeout=60)
            self.log_file.close()
            raise
        self.startup = time.perf_counter() - t

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
            self.log_file.write(line)  # vLLM logs to stdout: its kernel choices are among these lines
            self.log_file.flush()
        self.proc.wait(timeout=60)
        raise RuntimeError(f"vLLM exited ({self.last_error()}); see {self.log}")

    def last_error(self) -> str:
        """The last line vLLM wrote to its log (an exception's), without its rank prefix."""
        lines = [line.removeprefix("[rank0]:").strip() for line in self.log.read_text(errors="replace").splitlines()]
        return next((line for line in reversed(lines) if line), "no output")

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        a = self.generate(prompts, max_tokens)
        return a["seconds"], a["tokens"]

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0) -> dict:
        """The worker's answer: {"seconds", "tokens", "token_ids"} (sampled with seed 0 at temperature > 0)."""
        self.proc.stdin.write(json.dumps(dict(prompts=prompts, max_tokens=max_tokens, temperature=temperature)) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def kernels(self) -> list[str]:
        """What vLLM's log says of the kernels it picked ("Using CPUWNA16LinearKernel for mixed-precision linear")."""
        lines = self.log.read_text(errors="replace").splitlines()
        return sorted({line[line.index("Using "):].strip() for line in lines if "Using " in line and "Kernel" in line})

    def close(self) -> None:
        """Ask the worker to quit; kill it where it has died mid-job or does not exit within a minute."""
        from quantkit.bench.llamacpp_process import quit_worker

        quit_worker(self.proc)
        self.log_file.close()
