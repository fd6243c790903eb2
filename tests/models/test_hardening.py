"""Files from elsewhere are checked before they cost anything: a probe config asking for huge widths, a
probe card with malformed fields, a GGUF file replaced in place keeping its size and mtime."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from semspec.models.project.probe_card import card_from_json
from semspec.models.spec.probe import CONFIG_FILE, ProbeMLP, load_probe_folder, save_probe


def test_a_probe_config_asking_for_huge_widths_is_refused_before_allocating(tmp_path):
    save_probe(ProbeMLP(8, [4]), tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config["hidden"] = [10**9]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="exceed what a probe may be"):
        load_probe_folder(tmp_path)


def _card(**entry_changes) -> dict:
    entry = {
        "path": "draft-all",
        "model_id": "m",
        "format": "int8",
        "feature": "h_mean",
        "hidden_size": 8,
        "pooling": "step",
        "sha256": "0" * 64,
        "config_sha256": "0" * 64,
        **entry_changes,
    }
    return {
        "kind": "semspec-probes",
        "format_version": 1,
        "pair": "p",
        "probes": {"all": {"draft": entry, "target": dict(entry, path="target-all")}},
    }


@pytest.mark.parametrize(
    "bad", [{"metrics": {"auroc": [1]}}, {"floors": "x"}, {"routing": 3}, {"tags": ["a"]}, {"metrics": "x"}]
)
def test_malformed_card_fields_are_value_errors_naming_the_entry(bad):
    data = _card(**bad)
    with pytest.raises(ValueError, match=r"probes\['all'\]\['draft'\]"):
        card_from_json(data)


def test_a_file_replaced_in_place_with_its_size_and_mtime_is_hashed_again(tmp_path, monkeypatch):
    from semspec.models.lm import weights

    monkeypatch.setattr(weights, "cache_dir", lambda: tmp_path / "cache")
    f = tmp_path / "model.gguf"
    f.write_bytes(b"a" * 64)
    good = hashlib.sha256(b"a" * 64).hexdigest()
    weights.verify_sha256(f, good, "model")  # hashed, then stamped
    st = f.stat()
    replaced = tmp_path / "other.gguf"
    replaced.write_bytes(b"b" * 64)
    os.replace(replaced, f)  # same path and size; a new inode
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime
    with pytest.raises(ValueError):
        weights.verify_sha256(f, good, "model")
