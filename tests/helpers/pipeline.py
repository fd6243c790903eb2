"""A tiny model pair saved to a folder, so stages (and Ray actors) can load it by its config."""

from __future__ import annotations

from pathlib import Path

import yaml

from semspec.models.lm.pair import PairConfig
from semspec.models.project.pairs import load_pair
from tests.helpers.tiny import char_tokenizer, tiny_llama


def write_tiny_pair(
    folder: Path,
    name: str = "tiny",
    max_step_tokens: int = 8,
    draft_hidden: int = 32,
    target_hidden: int = 64,
    layers: int = 2,
    dtype: str = "float32",
) -> PairConfig:
    """Save a tiny draft and target (different widths) and their pair YAML (both models in ``dtype``,
    float32 by default: exact comparisons); return the parsed pair."""
    tok = char_tokenizer()
    for role, seed, hidden in (("draft", 0, draft_hidden), ("target", 1, target_hidden)):
        d = folder / role
        tiny_llama(len(tok), seed=seed, hidden=hidden, layers=layers).save_pretrained(d)
        tok.save_pretrained(d)
    model_cfg = {"source": "local", "prompt": "plain", "max_step_tokens": max_step_tokens, "dtype": dtype}
    pair = {
        "name": name,
        "draft": {"model_id": f"{name}-draft", "path": str(folder / "draft"), **model_cfg},
        "target": {"model_id": f"{name}-target", "path": str(folder / "target"), **model_cfg},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(pair))
    return load_pair(path)
