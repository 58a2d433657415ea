"""The AWQ plan file: one name, one key scheme, save and load (quantize writes it, check and --load-plan read it)."""

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.format.awq_plan import PLAN_FILE, PlanFile, clip_key, layer_prefix, load_plan, save_plan, scale_key
from quantkit.model.checkpoint import NOT_WEIGHT_FILES


def test_keys():
    assert layer_prefix(3) + scale_key("qkv") == "layers.3.qkv.scale"
    assert layer_prefix(0) + clip_key("mlp.down_proj") == "layers.0.mlp.down_proj.clip"


def test_save_then_load_round_trip_as_fp32(tmp_path):
    plan = {"layers.0.qkv.scale": torch.rand(8, dtype=torch.float16),
            "layers.0.mlp.down_proj.clip": torch.rand(4, 2).t()}  # non-contiguous
    path = tmp_path / PLAN_FILE
    save_plan(plan, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [PLAN_FILE]  # no temporary file left
    loaded = load_plan(path)
    assert loaded.keys() == plan.keys()
    for key, value in plan.items():
        assert loaded[key].dtype == torch.float32
        torch.testing.assert_close(loaded[key], value.float())
    assert PlanFile(path).layer_count() == 1


def test_missing_or_damaged_file_is_a_one_line_error(tmp_path):
    with pytest.raises(QuantkitError, match=r"^AWQ plan .*nope\.safetensors: no such file$"):
        load_plan(tmp_path / "nope.safetensors")
    bad = tmp_path / PLAN_FILE
    bad.write_bytes(b"not safetensors")
    with pytest.raises(QuantkitError, match="--load-plan .*: not a readable safetensors file"):
        PlanFile(bad)


def test_checkpoint_readers_skip_the_plan_file():
    assert PLAN_FILE in NOT_WEIGHT_FILES


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_the_plan_file_takes_the_umask_as_the_shards_do(tmp_path, umask, mode):
    """Written through open() as the weight shards are, so the process's umask decides its mode (safetensors'
    own writer made it 0600 whatever the umask: unreadable to the group that serves the checkpoint)."""
    import os

    old = os.umask(umask)
    try:
        save_plan({"layers.0.qkv.scale": torch.ones(4)}, tmp_path / PLAN_FILE)
    finally:
        os.umask(old)
    assert (tmp_path / PLAN_FILE).stat().st_mode & 0o777 == mode
    assert load_plan(tmp_path / PLAN_FILE)["layers.0.qkv.scale"].tolist() == [1.0] * 4
