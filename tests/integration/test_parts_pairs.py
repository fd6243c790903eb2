"""The reasoning pairs' real part packages (installed by scripts/setup): joined in order into the cache, the
sha256 pinned in the pair file checked, shared weights joined once; GGUF headers name the right models."""

from __future__ import annotations

from pathlib import Path

import pytest

from semspec.models.lm.weights import parts_missing, resolve_model
from semspec.models.project.pairs import load_pair

pytestmark = pytest.mark.embedded


@pytest.mark.parametrize("role, name", [("draft", "Qwen2.5 Coder 0.5B"), ("target", "Qwen2.5 Coder 1.5B")])
def test_qwen_parts_join_to_the_pinned_file(role, name):
    model_cfg = load_pair("qwen-coder").role(role)
    assert parts_missing(model_cfg.packages) == [], "scripts/setup installs every part package"
    path = Path(resolve_model(model_cfg)) / model_cfg.gguf_file  # joins (or reuses) and checks the sha256
    from gguf import GGUFReader

    meta = GGUFReader(path).fields["general.name"]
    assert name.lower() in bytes(meta.parts[meta.data[0]]).decode().lower()


def test_smollm_qwen_shares_the_target_file():
    a, b = load_pair("smollm-qwen").target, load_pair("qwen-coder").target
    assert resolve_model(a) == resolve_model(b)


def test_embedded_target_file_matches_its_pin():
    model_cfg = load_pair("embedded").target
    assert (
        model_cfg.sha256
        and (Path(resolve_model(model_cfg)) / model_cfg.gguf_file).stat().st_size == 253_113_024
    )
