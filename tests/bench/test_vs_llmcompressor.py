"""The comparison with llm-compressor and GPTQModel: its method table, the commands built for the peers' workers,
the check of a peer's venv, runs joined per seed, and the mean line over seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from interop.gptqmodel_gptq import parser as gptqmodel_parser
from quantkit.bench.llmc_table import header, mean_lines, merge_rows, print_table, table_lines
from quantkit.bench.vs_llmcompressor import (CALIB, METHODS, PEERS, TOOLS, Windows, check_peer, float_reference,
                                             parse_methods, parse_tools, real_shape, run_ours, score_checkpoint,
                                             worker_args)


def _side(ratio: float, wall: float, sha: str = "h", **fidelity: float) -> dict:
    return {"ratio": ratio, "ppl": 30 * ratio, "wall_s": wall, "hash": sha, **fidelity}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_split_runs_join_per_seed_and_keep_the_seeds_apart():
    rows = [{"model": "tiny", "method": "awq", "seed": s, "ours": _side(1.0 + s / 100, 2.0, f"h{s}")} for s in (0, 1)]
    rows += [{"model": "tiny", "method": "awq", "seed": s, "peer": _side(1.01, 4.0, f"h{s}")} for s in (0, 1)]
    merged = merge_rows(rows)
    assert [(m["seed"], set(m) & {"ours", "peer"}) for m in merged] == [(0, {"ours", "peer"}), (1, {"ours", "peer"})]


@pytest.mark.parametrize("peer", ["peer", "gptqmodel"])
def test_a_seed_whose_windows_differ_between_the_tools_is_refused(peer):
    rows = [{"model": "tiny", "method": "gptq", "seed": 0, "ours": _side(1.0, 2.0, "a")},
            {"model": "tiny", "method": "gptq", "seed": 0, peer: _side(1.0, 4.0, "b")}]
    with pytest.raises(SystemExit, match="windows differ"):
        merge_rows(rows)


def test_the_mean_line_averages_ratios_and_seconds_over_seeds():
    rows = [{"model": "tiny", "method": "gptq", "seed": s, "ours": _side(r, w), "peer": _side(p, pw)}
            for s, r, w, p, pw in [(0, 1.002, 1.0, 1.004, 4.0), (1, 1.004, 3.0, 1.000, 4.0)]]
    (line,) = mean_lines(rows)
    cells = _cells(line)
    assert cells[1] == "**gptq, mean of 2 seeds**"
    assert cells[2:5] == ["1.0030x (1.0020-1.0040)", "1.0020x (1.0000-1.0040)", "-"]  # quantkit, llm-compressor, GPTQModel
    assert cells[11:16] == ["2.00", "4.00", "-", "0.50x", "-"]  # seconds per tool, then ours over each peer's


def test_gptqmodel_gets_its_own_columns_and_joins_the_other_tools_runs():
    rows = [{"model": "tiny", "method": "gptq", "seed": s, "ours": _side(1.002, 1.0, f"h{s}")} for s in (0, 1)]
    rows += [{"model": "tiny", "method": "gptq", "seed": s, "gptqmodel": _side(r, 4.0, f"h{s}")}
             for s, r in ((0, 1.001), (1, 1.003))]
    (line,) = mean_lines(merge_rows(rows))
    cells = _cells(line)
    assert cells[2:5] == ["1.0020x (1.0020-1.0020)", "-", "1.0020x (1.0010-1.0030)"]
    assert cells[11:16] == ["1.00", "-", "4.00", "-", "0.25x"]


def test_every_method_runs_in_some_tool_and_gar_is_on_only_in_gptq():
    assert all(any(getattr(spec, tool) is not None for tool in TOOLS) for spec in METHODS.values())
    with_gptqmodel = {m: spec.gptqmodel for m, spec in METHODS.items() if spec.gptqmodel is not None}
    assert with_gptqmodel == {"gptq": ["--gar", "true"], "gptq-nogar": ["--gar", "false"],
                              "gptaq": ["--gar", "false", "--gptaq", "0.25"], "gptaq-1": ["--gar", "false", "--gptaq", "1"],
                              "gptaq-gar": ["--gar", "true", "--gptaq", "0.25"]}
    # quantkit's GAR is its own method: plain `gptq` stays GAR-free in quantkit
    assert "--act-group-aware" in METHODS["gptq-gar"].ours and "--act-group-aware" not in METHODS["gptq"].ours
    # GPTAQ: the same alpha in both tools (quantkit's default is GPTQModel's 0.25)
    assert "--gptaq-alpha" not in METHODS["gptaq"].ours and METHODS["gptaq-1"].ours[-2:] == ["--gptaq-alpha", "1"]


@pytest.mark.parametrize(("method", "gar", "gptaq"), [("gptq", True, None), ("gptq-nogar", False, None),
                                                    ("gptaq", False, 0.25), ("gptaq-gar", True, 0.25)])
def test_the_gptqmodel_worker_accepts_the_command_built_for_it(method, gar, gptaq, tmp_path):
    args = worker_args("gptqmodel", method, tmp_path / "model", tmp_path / "out", 64, "attention", 1, 2)
    parsed = gptqmodel_parser().parse_args(args)
    assert (parsed.gar == "true") == gar and parsed.gptaq == gptaq
    assert (parsed.group_size, parsed.targets, parsed.seed, parsed.threads, parsed.damp) == (64, "attention", 2, 1, 0.01)
    assert (parsed.nsamples, parsed.seqlen, Path(parsed.calib).name) == (32, 256, "valid.txt")
    assert parsed.out == tmp_path / "out" and not parsed.version


def test_llm_compressor_keeps_its_perplexity_arguments_and_gptqmodel_gets_none():
    llmc = worker_args("peer", "gptq", Path("m"), Path("o"), 64, "all", 1, 0)
    assert llmc[:2] == ["--method", "gptq"] and "--ppl-tokens" in llmc and "--gar" not in llmc
    assert "--ppl-text" not in worker_args("gptqmodel", "gptq", Path("m"), Path("o"), 64, "all", 1, 0)


def test_tools_and_methods_are_checked_with_one_line():
    assert parse_tools("ours,gptqmodel") == {"ours", "gptqmodel"}
    assert parse_methods("gptq, gptq-nogar") == ["gptq", "gptq-nogar"]
    with pytest.raises(SystemExit, match="--tools takes"):
        parse_tools("ours,autogptq")
    with pytest.raises(SystemExit, match="unknown gptq-gptaq"):
        parse_methods("gptq,gptq-gptaq")


def test_a_missing_peer_venv_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"GPTQModel's python not found at .*--gptqmodel-python; install steps") as err:
        check_peer(tmp_path / "venv" / "bin" / "python", "gptqmodel")
    assert "\n" not in str(err.value)


def test_a_venv_without_gptqmodel_is_one_line():
    """quantkit's own venv has no gptqmodel: the worker's --version fails, and says so in one line."""
    with pytest.raises(SystemExit, match="GPTQModel is not usable with .*No module named 'gptqmodel'") as err:
        check_peer(Path(sys.executable), "gptqmodel")
    assert "\n" not in str(err.value) and PEERS["gptqmodel"].install in str(err.value)


def test_a_real_shape_cut_to_n_layers_is_named_shape_colon_n():
    shape = real_shape("llama-3.1-8b:2")
    assert (shape.name, shape.layers, shape.hidden) == ("llama-3.1-8b-2layers", 2, 4096)
    assert real_shape("llama-3.2-1b").layers == 16 and real_shape("tiny") is None and real_shape("mha-w64-d4") is None
    with pytest.raises(SystemExit, match="the layer count after ':' is a whole number") as err:
        real_shape("llama-3.1-8b:two")
    assert "\n" not in str(err.value)


def test_every_worker_reads_the_windows_asked_for(tmp_path):
    args = worker_args("gptqmodel", "gptq", tmp_path / "m", tmp_path / "o", 128, "all", 2, 0, Windows(16, 512))
    parsed = gptqmodel_parser().parse_args(args)
    assert (parsed.nsamples, parsed.seqlen, parsed.threads) == (16, 512, 2)
    llmc = worker_args("peer", "awq", Path("m"), Path("o"), 128, "all", 2, 0, Windows(16, 512))
    assert llmc[llmc.index("--nsamples") + 1] == "16" and llmc[llmc.index("--seqlen") + 1] == "512"


def test_an_unscored_real_shape_row_prints_times_and_peak_rss_and_dashes_for_perplexity(capsys):
    side = {"ppl": None, "ratio": None, "hash": "h"}
    rows = [{"model": "llama-3.1-8b:2", "method": "gptq", "seed": 0,
             "ours": {**side, "wall_s": 60.0, "process_s": 75.5, "peak_rss_gib": 4.25, "layer_s": [29.0, 28.0]},
             "peer": {**side, "wall_s": 240.0, "peak_rss_gib": 9.5}}]
    print_table(rows)
    head, _, line = capsys.readouterr().out.splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    cells = dict(zip(cols, (c.strip() for c in line.strip("|").split("|"))))
    assert cells["quantkit ppl (x float)"] == cells["llm-compressor ppl (x float)"] == "-"
    assert (cells["quantkit s"], cells["llm-compressor s"], cells["time ours/llm-compressor"]) == ("60.00", "240.00", "0.25x")
    assert (cells["quantkit peak RSS GiB"], cells["llm-compressor peak RSS GiB"], cells["GPTQModel peak RSS GiB"]) == (
        "4.25", "9.50", "-")
    assert mean_lines(rows * 2)[0].count("|") == len(cols) + 1  # the mean line fills every column


def test_the_table_renders_logs_with_and_without_the_fidelity_figures():
    """Rows of logs older than the fidelity figures show "-" there; new rows show KL x1e-3 and top-1 %, per tool;
    the mean line averages them over the seeds that have them. Every line has the header's columns."""
    old = [{"model": "m", "method": "gptq", "seed": 0, "ours": _side(1.002, 1.0), "peer": _side(1.003, 2.0)}]
    new = [{"model": "m", "method": "gptq", "seed": 1, "ours": _side(1.001, 1.0, kl=0.002, top1=0.95),
            "peer": _side(1.004, 2.0, kl=0.004, top1=0.90, ppl_qk=30.1)}]
    lines = table_lines(merge_rows(old + new))
    head = _cells(lines[0])
    assert head[5:11] == ["quantkit KL x1e-3", "llm-compressor KL x1e-3", "GPTQModel KL x1e-3",
                          "quantkit top-1 %", "llm-compressor top-1 %", "GPTQModel top-1 %"]
    assert all(len(_cells(line)) == len(head) for line in lines[2:])
    (old_line,), (new_line,) = [ln for ln in lines if "seed 0" in ln], [ln for ln in lines if "seed 1" in ln]
    assert _cells(old_line)[5:11] == ["-"] * 6
    assert _cells(new_line)[5:11] == ["2.000", "4.000", "-", "95.00", "90.00", "-"]
    # the mean line: the mean over the one seed that has them
    assert _cells(lines[-1])[5:11] == ["2.000", "4.000", "-", "95.00", "90.00", "-"]
    assert len(lines) == len(header()) + 3


@pytest.mark.usefixtures("one_torch_thread")
def test_a_checkpoint_against_its_own_float_model_has_kl_zero_and_rtn_moves_it(stories_dir, tmp_path):
    """The bench's scoring on stories260K-hf: the float checkpoint against itself, then quantkit's RTN of it."""
    if not CALIB.is_file():
        pytest.skip(f"shared data not found at {CALIB}")
    ref = float_reference(stories_dir)
    same = score_checkpoint(stories_dir, ref)
    assert (same["kl"], same["top1"], same["ratio"]) == (0.0, 1.0, 1.0)
    rtn = run_ours(stories_dir, tmp_path / "rtn", "rtn", 64, 1, ref)
    assert rtn["kl"] > 1e-3 and 0.5 < rtn["top1"] < 1.0 and rtn["ratio"] > 1.0, rtn
