"""Recipes in configs/: loaded by `quantize --config`, overridden by flags, listed, recorded in the metadata."""

import json
from pathlib import Path

import pytest

from quantkit.errors import QuantkitError
from quantkit.recipes import list_recipes, load_recipe
from tests_support.cli import run_cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = ["awq-w4g128", "ct-w4a16-asym", "ct-w4a16", "ct-w8a16", "gptaq-w4g128", "gptq-w4g128-actorder", "gptq-w4g128", "rtn-w8"]


def test_list_configs_lists_recipes_not_test_data():
    assert [r.name for r in list_recipes(CONFIGS)] == RECIPES
    code, output = run_cli("quantize", "--list-configs")
    assert code == 0 and "gptq-w4g128-actorder" in output and "accuracy_floors" not in output


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_is_a_valid_quantize_config(name, tiny_llama):
    recipe = load_recipe(CONFIGS / f"{name}.toml")
    code, output = run_cli("quantize", tiny_llama, "--out", "unused", "--config", CONFIGS / f"{name}.toml", "--dry-run")
    assert code == 0, output
    v = recipe.values
    assert f"method {v['method']}, {v['bits']}-bit, group size {v['group_size']}" in output


def test_flags_on_the_command_line_win(tiny_llama):
    code, output = run_cli("quantize", tiny_llama, "--out", "unused", "--config", CONFIGS / "gptq-w4g128.toml",
                           "--group-size", "64", "--format", "compressed-tensors", "--dry-run")
    assert code == 0, output
    assert "method gptq, 4-bit, group size 64, layout compressed-tensors" in output


def test_unknown_keys_are_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('method = "gptq"\nbitz = 4\ngroupsize = 64\n')
    with pytest.raises(QuantkitError, match="unknown recipe keys bitz, groupsize"):
        load_recipe(bad)
    code, output = run_cli("quantize", "m", "--out", "o", "--config", bad)
    assert code == 2 and "bitz" in output


@pytest.mark.slow
def test_recipe_recorded_in_metadata(tiny_llama, tmp_path):
    out = tmp_path / "q"
    code, output = run_cli("quantize", tiny_llama, "--out", out, "--config", CONFIGS / "rtn-w8.toml", "--seed", "3")
    assert code == 0, output
    meta = json.loads((out / "quantkit_meta.json").read_text())
    assert meta["config"]["recipe"]["name"] == "rtn-w8" and meta["config"]["recipe"]["values"]["bits"] == 8
    assert (meta["config"]["bits"], meta["config"]["group_size"], meta["config"]["calib"]["seed"]) == (8, -1, 3)


def test_a_shipped_recipe_is_found_by_name_and_an_unknown_name_is_one_line(tiny_llama):
    code, output = run_cli("quantize", tiny_llama, "--out", "unused", "--config", "gptq-w4g128", "--dry-run")
    assert code == 0, output
    assert "method gptq, 4-bit, group size 128" in output
    code, output = run_cli("quantize", tiny_llama, "--out", "unused", "--config", "gptq-w4g128.toml", "--dry-run")
    assert code == 0, output
    code, output = run_cli("quantize", tiny_llama, "--out", "unused", "--config", "gptq-w9", "--dry-run")
    assert code == 2 and "no shipped recipe of that name" in output and "gptq-w4g128-actorder" in output


def test_the_recipes_list_is_a_result_on_stdout(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", "--list-configs"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)  # from another folder: the shipped recipes all the same
    assert done.returncode == 0 and "gptq-w4g128" in done.stdout and "gptq-w4g128" not in done.stderr
