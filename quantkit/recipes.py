"""Quantization recipes: TOML presets in configs/ for `quantkit quantize --config`.

A recipe is a flat TOML table of `quantkit quantize` option names (snake_case) and a `description`;
flags given on the command line win over it. A TOML file in configs/ without a `method` key (e.g.
accuracy_floors.toml, test data) is not a recipe. The recipes ship with the package (quantkit/configs in a wheel,
configs/ in a checkout): `--config gptq-w4g128` finds one by name, and a path to any TOML file works too.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError

RECIPE_KEYS = frozenset({
    "method", "format", "bits", "group_size", "sym", "desc_act", "act_group_aware", "static_groups", "damp", "true_sequential",
    "gptaq", "gptaq_alpha",
    "calib", "nsamples", "seqlen", "seed", "awq_duo_scaling", "awq_row_gain", "awq_search_tokens", "scale_search", "max_shard_size_gb",
})


@dataclass(frozen=True)
class Recipe:
    name: str
    path: str
    description: str
    values: dict

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "description": self.description, "values": dict(self.values)}


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe; unknown keys are an error that names them."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise QuantkitError(f"{path}: unreadable recipe ({exc})") from exc
    description = str(data.pop("description", ""))
    unknown = sorted(set(data) - RECIPE_KEYS)
    if unknown:
        raise QuantkitError(f"{path}: unknown recipe keys {', '.join(unknown)} "
                            f"(known: description, {', '.join(sorted(RECIPE_KEYS))})")
    if "method" not in data:
        raise QuantkitError(f"{path}: not a quantize recipe (no `method` key)")
    return Recipe(path.stem, str(path), description, data)


def list_recipes(folder: Path) -> list[Recipe]:
    """Every recipe in `folder` (TOML files with a `method` key), by name."""
    out = []
    for file in sorted(Path(folder).glob("*.toml")):
        try:
            has_method = "method" in tomllib.loads(file.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if has_method:
            out.append(load_recipe(file))
    return out


def default_config_dir() -> Path:
    """The recipes that ship with quantkit: quantkit/configs in an installed wheel, configs/ beside quantkit/ in a
    checkout."""
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def find_recipe(given: str | Path) -> Path:
    """`--config`'s value: a path to a TOML file, or the name of a shipped recipe (with or without .toml)."""
    path = Path(given)
    if path.is_file():
        return path
    shipped = default_config_dir() / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    names = ", ".join(r.name for r in list_recipes(default_config_dir()))
    raise QuantkitError(f"{given}: no such recipe file, and no shipped recipe of that name (shipped: {names})")


def merge(recipe: Recipe | None, given: dict, defaults: dict) -> dict:
    """Option values: those given on the command line, else the recipe's, else the defaults."""
    values = dict(defaults)
    if recipe is not None:
        values.update(recipe.values)
    values.update(given)
    return values
