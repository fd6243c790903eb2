"""Exported probe folders read without MLflow: the card, the checks before a model loads, the fit checks
and sha256 when a probe loads, Hub repo ids through snapshot_download."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from semspec.models.lm.pair import ModelConfig, PairConfig
from semspec.models.project.probe_card import (
    CARD_FILE,
    CARD_VERSION,
    CardProbe,
    ProbeCard,
    check_card,
    load_card_probe,
    probe_folder_name,
    write_card,
)
from semspec.models.project.probe_folder import read_card, resolve_probes
from semspec.models.spec.probe import ProbeMLP, save_probe, sha256_of

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = {"draft": 8, "target": 12}
MODEL_SHA = "ab" * 32


def _probe(width: int, seed: int) -> ProbeMLP:
    torch.manual_seed(seed)
    probe = ProbeMLP(width, [4], "all")
    probe.set_standardization(torch.randn(16, width) * 2 + 1)
    return probe.eval()


def _entry(folder: Path, role: str, key: str, probe: ProbeMLP, **fields) -> CardProbe:
    path = probe_folder_name(role, key)
    sha = save_probe(probe, folder / path)
    base = {
        "path": path,
        "model_id": f"m-{role}",
        "model_sha256": MODEL_SHA if role == "target" else None,
        "format": "float32",
        "feature": "h_mean",
        "hidden_size": WIDTHS[role],
        "pooling": "predict",
        "sha256": sha,
        "config_sha256": sha256_of(folder / path / "probe.json"),
        "registry": {"name": f"semspec-p-{role}-{key}", "version": "1", "run_id": None},
        "metrics": {"test_mse": 0.1},
        "routing": {"auroc": 0.7},
        "floors": {"min_ratio": 0.25 if role == "target" else None, "min_p": None, "accept_rate": None},
        "data_hash": None,
    }
    return CardProbe(**{**base, **fields})


def write_folder(folder: Path, keys: tuple[str, ...] = ("all",)) -> tuple[ProbeCard, dict]:
    """A folder of exported probes of pair ``p`` (models m-draft, m-target in float32) and its probes."""
    probes = {(k, r): _probe(WIDTHS[r], i) for i, (k, r) in enumerate((k, r) for k in keys for r in WIDTHS)}
    entries = {k: {r: _entry(folder, r, k, probes[k, r]) for r in WIDTHS} for k in keys}
    card = ProbeCard(CARD_VERSION, "p", entries, "2025-01-01T00:00:00+00:00")
    write_card(card, folder)
    return card, probes


def pair(**target) -> PairConfig:
    model_cfg = {"source": "local", "path": "/nonexistent", "dtype": "float32"}
    return PairConfig(
        name="p",
        draft=ModelConfig(model_id="m-draft", **model_cfg),
        target=ModelConfig(**{"model_id": "m-target", **model_cfg, **target}),
    )


def test_a_folder_reads_back_the_same_probes(tmp_path):
    card, probes = write_folder(tmp_path, ("all", "last@math"))
    back = read_card(tmp_path)
    assert back == card and back.folder == tmp_path and back.variants == ["all", "last@math"]
    assert back.floor("all", "min_ratio") == 0.25 and back.floor("all", "min_p") is None
    assert (tmp_path / "draft-last-math" / "probe.safetensors").is_file()
    for (key, role), original in probes.items():
        loaded, sha = load_card_probe(
            tmp_path, back, role, key, f"m-{role}", WIDTHS[role], "predict", "float32"
        )
        x = torch.randn(5, WIDTHS[role])
        assert torch.equal(loaded(x), original(x))
        assert sha == sha256_of(tmp_path / probe_folder_name(role, key) / "probe.safetensors")
    check_card(back, pair(sha256=MODEL_SHA.upper()), "all")  # a pinned sha256 compares case-blind


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"model_id": "other"}, "was trained on 'm-target', not on 'other'"),
        ({"hidden_size": 640}, "expects hidden size 12, the model has 640"),
        ({"pooling": "tokens"}, "pooled by 'predict', the pair pools by 'tokens'"),
        ({"fmt": "int8"}, r"run in float32, and the model runs in int8 here.*dtype: float32"),
    ],
)
def test_a_probe_that_does_not_fit_the_model_is_refused(tmp_path, args, message):
    card, _ = write_folder(tmp_path)
    call = {"model_id": "m-target", "hidden_size": 12, "pooling": "predict", "fmt": "float32", **args}
    with pytest.raises(ValueError, match=message):
        load_card_probe(tmp_path, card, "target", "all", **call)


def test_a_tampered_weights_file_is_refused(tmp_path):
    card, _ = write_folder(tmp_path)
    weights = tmp_path / "draft-all" / "probe.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its recorded sha256"):
        load_card_probe(tmp_path, card, "draft", "all", "m-draft", 8, "predict", "float32")
    with pytest.raises(ValueError, match=r"draft probe of 'all'.*does not match its recorded sha256"):
        check_card(read_card(tmp_path), pair(), "all")
    load_card_probe(tmp_path, card, "target", "all", "m-target", 12, "predict", "float32")  # untouched


@pytest.mark.parametrize(
    ("the_pair", "variant", "message"),
    [
        (pair(), "mix", r"no probes of variant 'mix'; it holds \['all'\]"),
        (PairConfig("q", pair().draft, pair().target), "all", "holds probes of pair 'p', not of 'q'"),
        (pair(model_id="m-other"), "all", "trained on 'm-target', and pair 'p' has 'm-other' as its target"),
        (pair(dtype="bfloat16"), "all", r"run in float32, and the model runs in bfloat16 here"),
        (pair(sha256="cd" * 32), "all", "pair file pins cdcd"),
    ],
)
def test_the_card_is_checked_against_the_pair_before_models_load(tmp_path, the_pair, variant, message):
    write_folder(tmp_path)
    with pytest.raises(ValueError, match=message):
        check_card(read_card(tmp_path), the_pair, variant)


def test_an_unknown_card_version_or_a_path_outside_the_folder_is_refused(tmp_path):
    card, _ = write_folder(tmp_path)
    path = tmp_path / CARD_FILE
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "format_version": CARD_VERSION + 1}))
    with pytest.raises(ValueError, match=rf"format version {CARD_VERSION + 1}.*reads version {CARD_VERSION}"):
        read_card(tmp_path)
    with pytest.raises(ValueError, match="format version 99"):
        check_card(ProbeCard(99, card.pair, card.probes), pair(), "all")
    data["probes"]["all"]["draft"]["path"] = "../elsewhere"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="must be a folder inside the card's folder"):
        read_card(tmp_path)


def test_a_local_folder_resolves_and_a_bad_source_says_what_to_pass(tmp_path):
    write_folder(tmp_path / "probes")
    assert resolve_probes(tmp_path / "probes") == (tmp_path / "probes").resolve()
    assert resolve_probes(str(tmp_path / "probes")) == (tmp_path / "probes").resolve()
    with pytest.raises(ValueError, match="no such folder, and not a Hugging Face Hub repo id"):
        resolve_probes(str(tmp_path / "missing" / "deeper"))
    with pytest.raises(ValueError, match=f"holds no {CARD_FILE}"):
        resolve_probes(tmp_path)


@pytest.mark.parametrize(
    ("source", "repo", "revision"), [("org/probes", "org/probes", None), ("org/p@v1", "org/p", "v1")]
)
def test_a_hub_repo_id_goes_through_snapshot_download(tmp_path, monkeypatch, source, repo, revision):
    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    write_folder(snapshot)
    calls = []

    def fake(repo_id, **kwargs):
        calls.append({"repo_id": repo_id, **kwargs})
        return str(snapshot)

    monkeypatch.chdir(tmp_path)  # no folder named like the repo id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_probes(source) == snapshot.resolve()
    (call,) = calls
    assert call["repo_id"] == repo and call["revision"] == revision
    assert call["local_files_only"] is True  # HF_HUB_OFFLINE: the cache only
    assert CARD_FILE in call["allow_patterns"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    from semspec.models.project.settings import settings

    settings.cache_clear()
    resolve_probes(source)
    assert calls[-1]["local_files_only"] is False


def test_a_hub_repo_missing_offline_says_how_to_get_it(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fake(repo_id, **kwargs):
        raise LocalEntryNotFoundError("not in cache")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(
        ValueError, match=r"org/probes@v2: not in the local Hugging Face cache and HF_HUB_OFFLINE"
    ):
        resolve_probes("org/probes@v2")


def test_reading_a_folder_imports_no_mlflow(tmp_path):
    write_folder(tmp_path)
    code = f"""
import sys
from pathlib import Path
import torch
from semspec.models.lm.pair import ModelConfig, PairConfig
from semspec.models.project.probe_card import load_card_probe
from semspec.models.project.probe_folder import read_card, resolve_probes
from semspec.tasks.decoders import check_probes
folder = resolve_probes({str(tmp_path)!r})
card = read_card(folder)
model_cfg = dict(source="local", path="/nonexistent", dtype="float32")
pair = PairConfig("p", ModelConfig(model_id="m-draft", **model_cfg), ModelConfig(model_id="m-target", **model_cfg))
check_probes(pair, "all", folder)
probe, sha = load_card_probe(folder, card, "draft", "all", "m-draft", 8, "predict", "float32")
assert 0 < float(probe(torch.randn(1, 8))[0]) < 1
bad = [m for m in ("mlflow", "prefect", "ray", "dvc") if m in sys.modules]
assert not bad, bad
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
