"""The wheel's package list (pyproject.toml) names every package folder of the source tree.

setuptools packs only the packages listed, so a new `quantkit/<sub>/__init__.py` left out of the list installs from
an editable checkout and is missing from `pip install quantkit`."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_dirs(config: dict) -> dict[str, Path]:
    """Each listed package's folder: package-dir's mappings, else its dotted path under the repository root."""
    mapped = config.get("package-dir", {})

    def folder(name: str) -> Path:
        for prefix, target in mapped.items():
            if name == prefix or name.startswith(prefix + "."):
                return ROOT / target / Path(*name[len(prefix) + 1:].split(".")) if name != prefix else ROOT / target
        return ROOT / Path(*name.split("."))

    return {name: folder(name) for name in config["packages"]}


def test_every_listed_package_is_a_folder():
    for name, folder in _source_dirs(_config()).items():
        assert folder.is_dir(), f"{name}: no folder {folder}"


def test_every_package_folder_is_listed():
    config = _config()
    listed = set(config["packages"])
    roots = {"quantkit": ROOT / "quantkit", **{name: ROOT / d for name, d in config.get("package-dir", {}).items()}}
    missing = []
    for root_name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            name = ".".join([root_name, *rel.parts])
            if "__pycache__" not in rel.parts and name not in listed:
                missing.append(name)
    assert not missing, f"package folders missing from pyproject.toml's packages: {sorted(missing)}"
