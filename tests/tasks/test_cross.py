"""The cross stage: each model's features over the other model's steps, as decoding computes them."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from semspec.models.lm.pair import PairConfig
from semspec.models.spec.semanticspec import SemanticSpecDecoder
from semspec.models.spec.settings import DecodeSettings
from semspec.tasks.config import SampleConfig
from semspec.tasks.cross import run_cross
from semspec.tasks.io import column_matrix, read_shards
from semspec.tasks.sample import run_sample
from tests.helpers.project import kill_mid_run
from tests.helpers.tiny import tiny_lm

QUESTIONS = ["What is 12 * 7?", "Tom has 3 apples and buys 5 more. How many?"]


def _prefixes(path, questions=QUESTIONS):
    rows = [
        {
            "prefix_id": f"p{i}",
            "question_id": f"q{i}",
            "source": "test",
            "domain": "math",
            "step_index": 0,
            "question": q,
            "context": "",
        }
        for i, q in enumerate(questions)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _pair(merged_target: bool):
    draft = tiny_lm(seed=1, hidden=32, max_step_tokens=12)
    target = tiny_lm(seed=2, hidden=64, max_step_tokens=12, merged=merged_target)
    return PairConfig(name="tiny", draft=draft.config, target=target.config), {
        "draft": draft,
        "target": target,
    }


class _Recorder:
    """A probe that remembers every pooled step it scores and says ``value``."""

    def __init__(self, value: float) -> None:
        self.value, self.seen = value, []

    def __call__(self, pooled):
        self.seen.append(pooled)
        return self.value


@pytest.mark.parametrize("merged_target", [False, True], ids=["one tokenizer", "two tokenizers"])
def test_the_stored_target_features_are_what_decoding_computes(tmp_path, merged_target):
    """For a prefix and a draft step: the target's features the stage stores equal the ones the
    SemanticSpec decoder pools when it verifies that step (greedy: the sample is the decoder's proposal)."""
    pair, lms = _pair(merged_target)
    assert (lms["draft"].tokenizer.get_vocab() == lms["target"].tokenizer.get_vocab()) is not merged_target
    prefixes = _prefixes(tmp_path / "prefixes.parquet")
    cfg = SampleConfig(n=2, temperature=0.0, executor="local", store_layers=True)
    run_sample(cfg, pair, prefixes, tmp_path / "samples", lms)
    run_cross(cfg, pair, prefixes, tmp_path / "samples", tmp_path / "cross", lms)
    stored = read_shards(tmp_path / "cross" / "target")
    assert set(stored.column("author").to_pylist()) == {"draft"}
    assert set(stored.column("role").to_pylist()) == {"target"}
    own = read_shards(tmp_path / "samples" / "draft")
    assert set(own.column("author").to_pylist()) == {"draft"}, "own samples say they are their own"
    for i, question in enumerate(QUESTIONS):
        q, p = _Recorder(0.5), _Recorder(1.0)  # accept: the target only verifies
        settings = DecodeSettings(max_new_tokens=12, step_tokens=12, temperature=0.0)
        SemanticSpecDecoder(lms["draft"], lms["target"], q, p, settings).decode(question)
        at_decode = p.seen[0]  # the target's pooled states over the draft's first step
        rows = [
            j
            for j, (pid, s) in enumerate(
                zip(
                    stored.column("prefix_id").to_pylist(),
                    stored.column("sample_idx").to_pylist(),
                    strict=True,
                )
            )
            if pid == f"p{i}" and s == 0
        ]
        assert len(rows) == 1
        for col, feat in (("h_last", "last"), ("h_mean", "all")):
            a = torch.from_numpy(column_matrix(stored, col)[rows[0]])
            b = at_decode.feature(feat).float()
            rel = float((a - b).abs().max() / b.abs().mean())
            assert rel < 1e-3, f"{col}: stored vs decode-time features differ by {rel:.2e}"
        layers = column_matrix(stored, "h_layers")[rows[0]].reshape(at_decode.h_layers.shape)
        assert torch.allclose(torch.from_numpy(layers).float(), at_decode.h_layers, atol=1e-2)


def test_each_role_reads_every_non_empty_step_of_the_other(tmp_path):
    pair, lms = _pair(False)
    prefixes = _prefixes(tmp_path / "prefixes.parquet")
    cfg = SampleConfig(n=3, temperature=0.8, executor="local", seed=3)
    run_sample(cfg, pair, prefixes, tmp_path / "samples", lms)
    run_cross(cfg, pair, prefixes, tmp_path / "samples", tmp_path / "cross", lms)
    for reader, author in (("draft", "target"), ("target", "draft")):
        src = read_shards(tmp_path / "samples" / author).to_pylist()
        got = read_shards(tmp_path / "cross" / reader).to_pylist()
        assert {(r["prefix_id"], r["sample_idx"]) for r in got} == {
            (r["prefix_id"], r["sample_idx"]) for r in src if r["text"]
        }
        by_key = {(r["prefix_id"], r["sample_idx"]): r for r in src}
        for r in got:
            assert r["text"] == by_key[(r["prefix_id"], r["sample_idx"])]["text"] and r["author"] == author
            assert r["model_id"] == pair.role(reader).model_id and len(r["h_last"]) == lms[reader].hidden_size


def test_cross_needs_both_roles_sampled(tmp_path):
    pair, lms = _pair(False)
    prefixes = _prefixes(tmp_path / "prefixes.parquet")
    cfg = SampleConfig(n=2, executor="local", roles=["draft"])
    run_sample(cfg, pair, prefixes, tmp_path / "samples", lms)
    with pytest.raises(ValueError, match=r"cross\[draft\] reads the target's samples.*run the sample stage"):
        run_cross(cfg, pair, prefixes, tmp_path / "samples", tmp_path / "cross", lms)


CROSS_SCRIPT = """
import sys
from pathlib import Path
from semspec.models.project.pairs import load_pair
from semspec.tasks.config import SampleConfig
from semspec.tasks.cross import run_cross
tmp = Path(sys.argv[1])
cfg = SampleConfig(n=16, executor="local", batch_prefixes=1, max_step_tokens=48)
run_cross(cfg, load_pair(tmp / "tiny.yaml"), tmp / "prefixes.parquet", tmp / "samples", tmp / "cross")
"""


@pytest.mark.reliability
def test_cross_resumes_after_a_kill_without_reading_finished_prefixes_again(tmp_path, monkeypatch, observed):
    import semspec.tasks.sample as sample_module
    from tests.helpers.pipeline import write_tiny_pair

    pair = write_tiny_pair(tmp_path, draft_hidden=128, target_hidden=128, layers=4)
    questions = [f"What is {i} * {i + 3}? Then add {i}." for i in range(8)]
    prefixes = _prefixes(tmp_path / "prefixes.parquet", questions)
    cfg = SampleConfig(n=16, executor="local", batch_prefixes=1, max_step_tokens=48)
    run_sample(cfg, pair, prefixes, tmp_path / "samples")
    shards = tmp_path / "cross" / "draft"  # the draft reads first (roles in order)
    kill_mid_run(CROSS_SCRIPT, tmp_path, lambda: len(list(shards.glob("part-*.parquet"))) >= 2, 120)
    before = {f.name: f.stat().st_mtime_ns for f in shards.glob("part-*.parquet")}
    assert 2 <= len(before) < 8, f"the kill should land mid-stage, found {len(before)} shards"
    read = []
    real = sample_module.read_rows

    def counted(lm, role, rows, cfg):
        read.extend((role, r["prefix_id"]) for r in rows)
        return real(lm, role, rows, cfg)

    monkeypatch.setattr(sample_module, "read_rows", counted)
    run_cross(cfg, pair, prefixes, tmp_path / "samples", tmp_path / "cross")
    after = {f.name: f.stat().st_mtime_ns for f in shards.glob("part-*.parquet")}
    assert all(after[k] == v for k, v in before.items()), "finished shards are kept as they were"
    assert sum(role == "draft" for role, _ in read) == 8 - len(before), "only the prefixes without a shard"
    for role in ("draft", "target"):
        rows = read_shards(tmp_path / "cross" / role, columns=["prefix_id", "sample_idx"]).to_pylist()
        assert len(rows) == len({(r["prefix_id"], r["sample_idx"]) for r in rows})
    observed(
        f"cross SIGKILLed with {len(before)} of 8 draft shards written; the rerun kept them and read "
        f"{sum(role == 'draft' for role, _ in read)} draft prefixes and {sum(r == 'target' for r, _ in read)} "
        "target prefixes"
    )
