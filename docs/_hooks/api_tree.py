"""mkdocs hook: lay out the installed ``semspec`` namespace for mkdocstrings to read statically.

The code folders install under one import name (pyproject's ``package-dir``: ``semspec.models`` is
``models/``, ``semspec.tasks`` is ``tasks/``, ``semspec.flows`` is ``flows/``, ``semspec`` itself is
``semspec/``). Griffe, which mkdocstrings uses, finds packages as folders on its search paths and does not
follow such a mapping, so this hook links them into ``build/docs-api/semspec/`` before the build, the
folder mkdocs.yml gives the python handler as its ``paths``. Nothing is imported.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

log = logging.getLogger("mkdocs.hooks.api_tree")

# import name -> folder, relative to the repository root (pyproject.toml's [tool.setuptools.package-dir])
PACKAGES = {"models": "models", "tasks": "tasks", "flows": "flows"}
TREE = Path("build") / "docs-api"


@event_priority(100)  # before mkdocstrings reads its handler options
def on_config(config):
    root = Path(config.config_file_path).resolve().parent
    tree = root / TREE / "semspec"
    if tree.exists() or tree.is_symlink():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    top = root / "semspec"
    for entry in top.iterdir() if top.is_dir() else ():
        if entry.name != "__pycache__":
            (tree / entry.name).symlink_to(entry)
    if not (tree / "__init__.py").exists():
        (tree / "__init__.py").write_text('"""semspec."""\n')
    for name, folder in PACKAGES.items():
        (tree / name).symlink_to(root / folder, target_is_directory=True)
    log.debug("api tree: %s", tree)
    return config
