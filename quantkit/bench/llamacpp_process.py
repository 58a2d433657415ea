"""llama-cpp-python in a subprocess of its own venv (quantkit/bench/llamacpp_worker.py), fed one JSON job per line.

The worker imports only llama_cpp, numpy and the standard library; it starts in the model's folder, never the
repository root, with the project's PYTHONPATH and OMP_NUM_THREADS removed (llama.cpp sizes its own threads).
`LlamaCppBatched` is the worker's `batched` mode: N sequences decoded together through llama_batch.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).resolve().with_name("llamacpp_worker.py")


def peer_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}


class WorkerProcess:
    """The worker in one of its line-fed modes; `ready` is its first answer ({"ready": true, "system_info", ...})."""

    def __init__(self, python: Path, mode: str, args: dict, cwd: Path, log: Path):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.proc = subprocess.Popen([str(python), str(WORKER), mode, json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=cwd,
                                     env=peer_env())
        self.ready = self.answer()
        self.system_info, self.version = self.ready["system_info"], self.ready["version"]

    def answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"llama.cpp worker exited; see {self.log}")

    def ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        quit_worker(self.proc)


def quit_worker(proc: subprocess.Popen) -> None:
    """Ask a line-fed peer worker to quit; kill it where it has died mid-job or does not exit within a minute."""
    try:
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(timeout=60)


@dataclass
class BatchedRun:
    prefill_s: float  # every prompt evaluated, one after another, and each first token
    decode_s: float  # the max_tokens - 1 lockstep steps after
    decode_tok_s: float  # sequences x (max_tokens - 1) / decode_s
    tokens: list[list[int]]  # each sequence's max_tokens greedy tokens


class LlamaCppBatched:
    """One GGUF in llama.cpp, N sequences decoded together (the worker's `batched` mode), greedy."""

    def __init__(self, python: Path, gguf: Path, threads: int, n_ctx: int, max_seqs: int, log: Path):
        self.worker = WorkerProcess(python, "batched", dict(model=str(gguf.resolve()), threads=threads, n_ctx=n_ctx,
                                                            max_seqs=max_seqs), gguf.resolve().parent, log)

    def run(self, prompts: list[list[int]], max_tokens: int) -> BatchedRun:
        a = self.worker.ask(dict(prompts=prompts, max_tokens=max_tokens))
        return BatchedRun(a["prefill_s"], a["decode_s"], a["decode_tok_s"], a["tokens"])

    def close(self) -> None:
        self.worker.close()
