"""Project discovery: the project folder and the model pairs configured in ``conf/pairs/``."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import yaml

from semspec.models.lm.pair import PairConfig
from semspec.models.project.settings import settings
from semspec.models.spec.steps import check_strategy

log = logging.getLogger(__name__)
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def project_root() -> Path:
    """The project folder (holding ``conf/``, ``params.yaml``, ``dvc.yaml``): ``SEMSPEC_PROJECT_DIR`` when
    set (a copy of the project elsewhere, e.g. for an isolated run), else this repository."""
    return settings().project_dir


def pairs_dir() -> Path:
    """Folder with one YAML file per model pair."""
    return project_root() / "conf" / "pairs"


def list_pairs(directory: Path | None = None) -> list[str]:
    """Names of the pairs configured in ``conf/pairs``."""
    d = directory or pairs_dir()
    return sorted(p.stem for p in d.glob("*.yaml"))


def load_pair(
    name_or_path: str | Path, directory: Path | None = None, split_strategy: str = "paragraph"
) -> PairConfig:
    """Load a pair by name (``conf/pairs/<name>.yaml``) or from an explicit YAML path; both models end
    their steps by ``split_strategy`` (params.yaml's, see ``models/spec/steps.py``)."""
    check_strategy(split_strategy)
    p = Path(name_or_path)
    if p.suffix not in (".yaml", ".yml"):
        if not _NAME_RE.fullmatch(str(name_or_path)):
            raise ValueError(
                f"pair name {str(name_or_path)!r} must be a file name in conf/pairs (letters, digits, '_', "
                f"'.', '-'; no path), or a path to a .yaml file"
            )
        p = (directory or pairs_dir()) / f"{name_or_path}.yaml"
    if not p.is_file():
        raise ValueError(
            f"unknown model pair {str(name_or_path)!r}: no file {p}; available: {', '.join(list_pairs(directory))}"
        )
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from e
    pair = PairConfig.from_dict(data, where=str(p))
    for model_cfg in (pair.draft, pair.target):
        model_cfg.split = split_strategy
    remote = [pair.draft, pair.target, pair.judge]
    for model_cfg in (x for x in remote if x is not None and x.trust_remote_code):
        log.warning(
            "pair %s: %s sets trust_remote_code: loading it runs Python code that ships with the model",
            pair.name,
            model_cfg.model_id,
        )
    return pair
