"""A C++ kernel extension as a git revision of this checkout built it, loaded beside the working tree's.

A kernel change is measured against the code before it in one process: this machine's speed drifts by up to 1.5x
within minutes, so two runs in turn compare the machine more than the code. `extension_at(rev, name, sources)`
copies kernels/csrc as it was at `rev` (headers included) out of git, compiles it with the flags the working tree's
build uses at this process's CPU level (quantkit.kernels.cpu_ext) under a module name of its own, and returns the module. Builds are cached
by the sources' git tree, so revisions that share their kernel sources share one build. `timed_rounds` times
the two builds' passes in turn, each reading its data from memory. Users: decode_attention --against,
linears_against.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.bench.rounds import round_order
from quantkit.kernels.cpu_ext import (CSRC, BuildError, active_level, build_dir, compile_extension, level_reason,
                                      toolchain_missing)

REPO = CSRC.parent.parent  # kernels/csrc -> the checkout


class RevisionError(RuntimeError):
    """Why a revision's extension cannot be had (one line)."""


def _git(*args: str) -> bytes:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=False, timeout=60)
    except FileNotFoundError as exc:
        raise RevisionError("git is not installed") from exc
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip().splitlines()
        raise RevisionError(reason[-1] if reason else f"git {' '.join(args)} failed")
    return done.stdout


def commit_of(rev: str) -> str:
    """The full commit hash `rev` names in this checkout; RevisionError where it names none."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").decode().strip()
    except RevisionError as exc:
        raise RevisionError(f"{rev!r} names no commit of {REPO} ({exc})") from None


def csrc_tree(commit: str) -> str:
    """The git tree id of kernels/csrc at `commit`: revisions with the same kernel sources share one build."""
    return _git("rev-parse", f"{commit}:{CSRC.relative_to(REPO).as_posix()}").decode().strip()


def sources_at(tree: str) -> Path:
    """The kernel sources of csrc tree `tree`, written once under the build folder; returns that folder."""
    out = build_dir() / f"csrc-{tree[:12]}"
    if (out / ".complete").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for path in _git("ls-tree", "--name-only", tree).decode().split():
        (out / path).write_bytes(_git("cat-file", "blob", f"{tree}:{path}"))
    (out / ".complete").write_text(tree)
    return out


def extension_at(rev: str, name: str, sources: tuple[str, ...]):
    """Extension `name` (sources: file names under kernels/csrc) as built from revision `rev`."""
    missing = toolchain_missing()
    if missing is not None:
        raise RevisionError(missing)
    tree = csrc_tree(commit_of(rev))
    src = sources_at(tree)
    absent = [s for s in sources if not (src / s).is_file()]
    if absent:
        raise RevisionError(f"{rev} has no {', '.join(absent)} in kernels/csrc")
    level = active_level()
    if level is None:
        raise RevisionError(f"no CPU level for the C++ kernels: {level_reason()}")
    module = f"{name}_{level.name}_{tree[:12]}"
    out = build_dir() / module
    built = (out / f"{module}.so").is_file()  # (a tree's sources never change: once built, always current)
    try:
        return compile_extension(module, [src / s for s in sources], out, level,
                                 announce=None if built else f"Compiling {name} as {rev} had it")
    except BuildError as exc:
        raise RevisionError(f"{name} at {rev} did not build: {exc}") from None


def timed_rounds(passes: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """ms of each pass (name -> callable), alternating (reversed every other round), each after 64 MiB of other writes (as an engine step's
    other work evicts the cache between two calls of a kernel), so that a pass reads its data from memory."""
    evict = torch.empty(64 << 20, dtype=torch.uint8)
    got: dict[str, list[float]] = {name: [] for name in passes}
    for r in range(rounds):
        for name, run in round_order(list(passes.items()), r):
            evict.add_(1)
            t = time.perf_counter()
            run()
            got[name].append((time.perf_counter() - t) * 1e3)
    return got


@dataclass(frozen=True)
class Comparison:
    ours_ms: float  # median ms of a pass with this tree's build
    theirs_ms: float  # the same with the revision's
    ratio: float  # the median of each round's theirs / ours (> 1: this tree is faster)
    max_diff: float  # the largest difference between the two builds' outputs


def compare(ours: Callable[[], Sequence[torch.Tensor]], theirs: Callable[[], Sequence[torch.Tensor]],
            rounds: int) -> Comparison:
    """Both passes' outputs side by side, then both timed by timed_rounds."""
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours(), theirs()))
    got = timed_rounds({"ours": ours, "theirs": theirs}, rounds)
    return Comparison(statistics.median(got["ours"]), statistics.median(got["theirs"]),
                      statistics.median(t / o for o, t in zip(got["ours"], got["theirs"])), diff)
