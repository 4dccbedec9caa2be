"""The recipes (*.yaml) and the hub targets' configs (targets/*.json), shipped as the package data of
`specdrafter.recipes` (pyproject.toml), so an installed wheel reads the same files as a checkout."""

from importlib.resources import files
from pathlib import Path

# A folder on disk: setuptools installs packages as plain files, and its readers (OmegaConf, AutoConfig) take paths.
RECIPES_DIR = Path(str(files(__name__)))
