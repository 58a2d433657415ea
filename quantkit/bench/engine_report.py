"""What `quantkit bench engine` measured, and its reports: each workload's rounds per system (WorkloadResult), one
model's comparison (Comparison) as JSON (`as_dict`) and as plain text (`lines`). Kept apart from the runs
(engine_vs_vllm.py), which fill them; `quantkit bench engine` renders its own rich table from the same fields."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field


@dataclass
class WorkloadResult:
    """One workload's rounds: output tokens/s, TTFT (seconds) and output tokens of each system, in round order."""

    workload: str
    tok_s: dict[str, list[float]] = field(default_factory=dict)
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    decode_tok_s: dict[str, list[float]] = field(default_factory=dict)  # fresh-prompt workloads only

    def median_tok_s(self, system: str) -> float:
        return statistics.median(self.tok_s[system])

    def median_ttft_s(self, system: str) -> float:
        return statistics.median(self.ttft_s[system])

    def median_decode_tok_s(self, system: str) -> float | None:
        return statistics.median(self.decode_tok_s[system]) if system in self.decode_tok_s else None

    def ratios(self) -> tuple[float, float] | None:
        """(tok/s, TTFT) of quantkit over vLLM, ratios of the medians; None without vLLM."""
        if "vLLM" not in self.tok_s:
            return None
        return (self.median_tok_s("quantkit") / self.median_tok_s("vLLM"),
                self.median_ttft_s("quantkit") / self.median_ttft_s("vLLM"))


@dataclass
class Comparison:
    """What one model's comparison measured."""

    label: str
    model: str
    dtype: str
    threads: int
    rounds: int
    load_average: tuple[float, float]
    startup_s: dict[str, float]
    quantkit_weights: str
    results: list[WorkloadResult]
    vllm_kernels: list[str] = field(default_factory=list)
    vllm_error: str | None = None
    rss: dict[str, tuple[int, int]] = field(default_factory=dict)  # bytes after load and at the end
    kv_cache: dict[str, str] = field(default_factory=dict)
    vllm_idle_cores: float | None = None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for r, d in zip(self.results, out["results"]):
            d["median_tok_s"] = {s: r.median_tok_s(s) for s in r.tok_s}
            d["median_ttft_s"] = {s: r.median_ttft_s(s) for s in r.ttft_s}
            d["median_decode_tok_s"] = {s: r.median_decode_tok_s(s) for s in r.decode_tok_s}
            ratios = r.ratios()
            d["tok_s_ratio"], d["ttft_ratio"] = ratios if ratios else (None, None)
        return out

    def lines(self) -> list[str]:
        """The plain-text report (`python -m quantkit.bench.engine --against-vllm`)."""
        lo, hi = self.load_average
        out = [f"\n== {self.label}, {self.dtype}, {self.threads} threads, median of {self.rounds} alternating rounds; "
               f"load average {lo:.1f}-{hi:.1f}; start-up: "
               + ", ".join(f"{n} {s:.1f} s" for n, s in self.startup_s.items()),
               f"quantkit {self.quantkit_weights}"]
        if self.vllm_error:
            out.append(f"vLLM did not run this model in {self.dtype}: {self.vllm_error}")
        for r in self.results:
            line = " | ".join(f"{n} {r.median_tok_s(n):8.1f} tok/s  TTFT {r.median_ttft_s(n) * 1e3:8.1f} ms"
                              for n in r.tok_s)
            if (ratios := r.ratios()) is not None:
                line += f" | tok/s ratio {ratios[0]:.2f}x, TTFT ratio {ratios[1]:.2f}x"
            out.append(f"({r.workload}) {line}")
            if r.decode_tok_s:
                out.append(f"({r.workload}) decode " + " | ".join(
                    f"{n} {r.median_decode_tok_s(n):8.1f} tok/s (range {min(v):.1f}-{max(v):.1f})"
                    for n, v in r.decode_tok_s.items()) + self._decode_ratio(r))
        out += [f"{n}: RSS after load {a / 2**20:.0f} MiB, at the end {b / 2**20:.0f} MiB; KV cache "
                f"{self.kv_cache.get(n, '?')}" for n, (a, b) in self.rss.items()]
        if self.vllm_idle_cores is not None:
            out.append(f"vLLM's worker idle after its jobs: {self.vllm_idle_cores:.2f} cores busy over 3 s; so it was "
                       f"stopped (SIGSTOP) between its jobs")
        out += [f"vLLM: {line}" for line in self.vllm_kernels]
        return out

    @staticmethod
    def _decode_ratio(r: WorkloadResult) -> str:
        if "vLLM" not in r.decode_tok_s:
            return ""
        return f" | decode ratio {r.median_decode_tok_s('quantkit') / r.median_decode_tok_s('vLLM'):.2f}x"

