"""`quantkit quantize`'s flag defaults are QuantizeConfig's: the command module keeps torch out of the CLI's start, so
it cannot import the config's constants and writes them again; this holds the two copies together."""

from __future__ import annotations

import dataclasses

from quantkit.commands.quantize import QuantizeFlags
from quantkit.config import QuantizeConfig


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def test_every_shared_flag_defaults_to_the_configs_default():
    flags, config = _defaults(QuantizeFlags), _defaults(QuantizeConfig)
    shared = sorted(set(flags) & set(config) - {"model", "out"})
    assert {"gptaq_alpha", "damp", "awq_search_tokens", "group_size", "method"} <= set(shared)
    differ = {k: (flags[k], config[k]) for k in shared if flags[k] != config[k]}
    # the CLI's None lets the method or the model's size decide, as the config does with its own None or default
    decided_later = {"low_memory"}
    assert {k: v for k, v in differ.items() if k not in decided_later} == {}
