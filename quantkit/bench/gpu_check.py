"""Everything that needs a GPU, in one call of at most 8 minutes: `bash kernels/gpu_check.sh OUTDIR`.

Steps, each in its own process under its own time budget; a step that fails or runs out of time
is recorded in the report, and the steps after it still run:
  tests   `pytest -m gpu`: the compiled kernels against their torch references, the engine on CUDA
  w4a16   `python -m quantkit.bench.w4a16`: the W4A16 kernel against cuBLAS, its markdown table
  model   a random Llama with TinyLlama-1.1B's shapes (quantkit.bench.gpu_steps)
  gptq    GPTQ quantization of it on the GPU: seconds per layer, peak GPU memory
  engine  the engine on the GPU (Triton paged attention compiled), float and GPTQ: tokens/s
It writes OUTDIR/gpu_check.md (the report), OUTDIR/gpu_check.json (the same figures) and each
step's output under OUTDIR/logs/. `--dry-run` runs every step at toy size on CPU tensors with the
Triton kernels in the interpreter (TRITON_INTERPRET=1): how CI checks this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantkit.bench.gpu_report import render


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: float
    needs_model: bool = False


STEPS = (Step("tests", 60), Step("w4a16", 150), Step("model", 45), Step("gptq", 90, True), Step("engine", 100, True))
# The w4a16 step's shapes: Llama-3-8B's linears (K x N). The kernel autotunes on its first call of each shape and M
# bucket, which takes most of the step (all six shapes of the full table ran past 100 s on an H200).
W4A16_SHAPES = "4096x14336,14336x4096,4096x1024"
GPU_TEST_FILES = "test_*_gpu.py"  # every GPU-marked test lives in such a file (tests/kernels/test_gpu_check.py)
TOTAL_BUDGET_S = 450  # 8 minutes, less the shell's install and start-up
DRY_SCALE = 3  # the dry run's budgets: the interpreter on a small shared CPU is slower than the GPU run


@dataclass
class StepResult:
    name: str
    status: str  # ok | failed (exit N) | timed out after N s | skipped: why
    seconds: float
    budget_s: float
    log_tail: str = ""
    figures: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_step(name: str, cmd: list[str], budget_s: float, log_path: Path, env: dict, cwd: Path) -> StepResult:
    """Run `cmd` with its output in `log_path`; past `budget_s` its whole process group is killed."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's own session: its children go too
            proc.wait()
            status = f"timed out after {budget_s:.0f} s"
    lines = log_path.read_text(errors="replace").splitlines()
    return StepResult(name, status, time.perf_counter() - start, budget_s, "\n".join(lines[-30:]))


def step_command(name: str, out: Path, work: Path, dry: bool, repo: Path) -> list[str]:
    py = sys.executable
    if name == "tests":  # -v: each test's name in the log as it finishes, so a step cut short shows how far it got
        # Only the GPU tests' files are collected: the others import what a GPU image may lack (uvicorn, lm_eval).
        files = sorted(str(p.relative_to(repo)) for p in (repo / "tests").rglob(GPU_TEST_FILES))
        return [py, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", f"--junitxml={work / 'tests.xml'}",
                *files]
    if name == "w4a16":
        toy = ["--device", "cpu", "--shapes", "128x72", "--m", "1,20", "--group-size", "64", "--iters", "1"]
        return [py, "-m", "quantkit.bench.w4a16", "--out", str(out / "w4a16.md"),
                *(toy if dry else ["--shapes", W4A16_SHAPES])]
    return [py, "-m", "quantkit.bench.gpu_steps", name, str(work / f"{name}.json"), str(work),
            *(["--dry-run"] if dry else [])]


def junit_counts(path: Path) -> dict:
    """Test counts and failed test ids from pytest's --junitxml file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "seconds": float(suite.get("time", 0)), "failed": failed}


def figures_of(name: str, out: Path, work: Path) -> dict:
    try:
        if name == "tests":
            return junit_counts(work / "tests.xml")
        if name == "w4a16":
            return {"table": (out / "w4a16.md").read_text()}
        return json.loads((work / f"{name}.json").read_text())
    except (OSError, ValueError, ET.ParseError, AttributeError):
        return {}  # the step died before writing its figures; its log says why


def child_env(dry: bool) -> dict:
    # QUANTKIT_CPU_ISA=none: the steps check the GPU paths; the C++ CPU kernels (tested on the CPU by the suite) would
    # only spend the budget compiling where the install carries none for this torch.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TQDM_DISABLE": "1", "QUANTKIT_CPU_ISA": "none", "PYTHONUNBUFFERED": "1"}
    if dry:  # CPU tensors only, kernels in the interpreter, and the gpu tests on the CPU (tests/conftest.py);
        # one torch thread: toy-sized ops on a shared CPU spend their time in OpenMP barriers otherwise
        env.update(TRITON_INTERPRET="1", QUANTKIT_GPU_DRY_RUN="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def run_all(out: Path, work: Path, dry: bool, total_s: float, repo: Path) -> list[StepResult]:
    scale = DRY_SCALE if dry else 1
    deadline = time.perf_counter() + total_s * scale
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results: list[StepResult] = []
    for step in STEPS:
        left = deadline - time.perf_counter()
        model = next((r for r in results if r.name == "model"), None)
        if step.needs_model and (model is None or not model.ok):
            results.append(StepResult(step.name, "skipped: no model (the model step failed)", 0, 0))
        elif step.name == "tests" and not (repo / "tests").is_dir():
            results.append(StepResult(step.name, "skipped: no tests/ here (they ship with the source, not the wheel)",
                                      0, 0))
        elif left < 5:
            results.append(StepResult(step.name, "skipped: no time left in the total budget", 0, 0))
        else:
            budget = min(step.budget_s * scale, left)
            print(f"gpu_check: {step.name} (budget {budget:.0f} s)", file=sys.stderr, flush=True)
            result = run_step(step.name, step_command(step.name, out, work, dry, repo), budget,
                              out / "logs" / f"{step.name}.log", child_env(dry), repo)
            result.figures = figures_of(step.name, out, work)
            results.append(result)
            print(f"gpu_check: {step.name}: {result.status} in {result.seconds:.0f} s", file=sys.stderr, flush=True)
    return results


def environment(dry: bool, repo: Path) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = torch.cuda.is_available() and not dry
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):  # no git here (an installed package on a bare machine)
        commit = ""
    return {"mode": "dry run" if dry else "gpu",
            "device": torch.cuda.get_device_name(0) if cuda else "CPU (Triton interpreter)",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "python": sys.version.split()[0], "commit": commit or "unknown",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--dry-run", action="store_true", help="toy sizes, CPU tensors, Triton interpreter")
    p.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for all steps (dry run: x3)")
    args = p.parse_args(argv)
    out, repo = args.outdir, Path.cwd()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = environment(args.dry_run, repo)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))  # the models (GiBs on a GPU) stay out of OUTDIR
    try:
        results = run_all(out, work, args.dry_run, args.budget, repo)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env["total_s"] = time.perf_counter() - start
    (out / "gpu_check.json").write_text(json.dumps({"environment": env, "steps": [asdict(r) for r in results]},
                                                   indent=1))
    (out / "gpu_check.md").write_text(render(env, results))
    print(f"gpu_check: report in {out / 'gpu_check.md'}", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
