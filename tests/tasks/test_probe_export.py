"""`semspec probes export|import`: champion probes from a temporary MLflow registry into a folder with its
card, back into a second, empty registry, and decoders built from the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from semspec.models.project.probe_card import CARD_FILE
from semspec.models.project.probe_folder import read_card
from semspec.models.spec.names import ROLES
from semspec.models.spec.probe import ProbeMLP, RandomProbe, save_probe

PAIR = "tp"
HIDDEN = {"draft": 32, "target": 48}
MODEL_IDS = {"draft": "tiny-llama-0", "target": "tiny-llama-1"}  # tests.helpers.tiny.tiny_lm's ids
TARGET_SHA = "0f" * 32
FLOORS = {"all": 0.375}  # min_ratio chosen on validation, tagged on both of the variant's probes


def write_pair(project: Path, draft_id: str = MODEL_IDS["draft"]) -> Path:
    """``project/conf/pairs/tp.yaml``: the pair the probes were trained for (target file pinned)."""
    model_cfg = {"source": "local", "path": "/nonexistent", "dtype": "float32"}
    data = {
        "name": PAIR,
        "draft": {"model_id": draft_id, **model_cfg},
        "target": {"model_id": MODEL_IDS["target"], "sha256": TARGET_SHA, **model_cfg},
    }
    path = project / "conf" / "pairs" / f"{PAIR}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def use_registry(monkeypatch, folder: Path) -> None:
    """Point MLflow (tracking, registry, artifacts) at an SQLite registry in ``folder``."""
    from semspec.models.project.settings import settings

    folder.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{folder}/mlruns.db")
    monkeypatch.setenv("SEMSPEC_MLFLOW_ARTIFACTS", str(folder / "artifacts"))
    settings.cache_clear()


def use_project(monkeypatch, project: Path) -> None:
    """Read pair files from ``project/conf/pairs``."""
    from semspec.models.project.settings import settings

    monkeypatch.setenv("SEMSPEC_PROJECT_DIR", str(project))
    settings.cache_clear()


def _tiny_probe(role: str, variant: str, seed: int):
    torch.manual_seed(seed)
    if variant == "random":
        return RandomProbe(HIDDEN[role], seed=seed)
    probe = ProbeMLP(HIDDEN[role], [8], variant)
    probe.set_standardization(torch.randn(20, HIDDEN[role]) * 3 + 1)
    return probe.eval()


def register(tmp_path: Path, role: str, variant: str, seed: int):
    """Register a tiny probe as the train stage does: a run with its metrics, a version with its tags."""
    import mlflow

    from semspec.tasks.probe_registry import register_probe, setup_experiment

    setup_experiment(PAIR)
    folder = tmp_path / "made" / f"{role}-{variant}-{seed}"
    save_probe(_tiny_probe(role, variant, seed), folder)
    tags = {
        "model_id": MODEL_IDS[role],
        "hidden_size": str(HIDDEN[role]),
        "format": "float32",
        "variant": variant,
        "feature": {"all": "h_mean", "last": "h_last"}.get(variant, "none"),
        "pooling": "predict",
        "examples": "own",
        "domain": "all",
        "pair": PAIR,
        "role": role,
        "git_commit": "abc123",
        "samples_hash": f"md5:{seed}",
        "labels_hash": f"md5:{seed + 100}",
        "test_mse": "0.0123",
        "config_hash": "cfg1",
        "source_hash": "src1",
    }
    if variant in FLOORS:
        tags["min_ratio"] = f"{FLOORS[variant]:.6g}"
    with mlflow.start_run(run_name=f"probe-{role}-{variant}", tags={"stage": "train", "pair": PAIR}):
        mlflow.log_metrics({"test_mse": 0.0123 + seed, "val_mse": 0.02, "routing_auroc": 0.61})
        return register_probe(folder, PAIR, role, variant, tags, description=f"{role} probe {variant}")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A registry with champions of ``all`` and ``random`` for both roles and of ``last`` for the draft
    only (an older ``all`` version too), and the pair file in a project folder; made once per module (no
    test writes to it). Returns its folder, the project folder and the refs by (role, variant)."""
    root = tmp_path_factory.mktemp("source")
    with pytest.MonkeyPatch.context() as mp:
        use_project(mp, root / "project")
        write_pair(root / "project")
        use_registry(mp, root / "a")
        refs = {}
        for seed, (role, variant) in enumerate(
            [("draft", "all"), ("draft", "all"), ("target", "all"), ("draft", "random"), ("target", "random")]
        ):
            refs[role, variant] = register(root, role, variant, seed)
        refs["draft", "last"] = register(root, "draft", "last", 9)
    return root, refs


@pytest.fixture
def registry(source, monkeypatch):
    """MLflow and the pair files pointed at ``source``'s; returns its refs by (role, variant)."""
    root, refs = source
    use_project(monkeypatch, root / "project")
    use_registry(monkeypatch, root / "a")
    return refs


def _outputs(probe, role: str) -> torch.Tensor:
    torch.manual_seed(7)
    return probe(torch.randn(6, HIDDEN[role]))


def _same_probe(a, b, role: str) -> bool:
    if isinstance(a, RandomProbe):  # a fresh generator each: the same draws from the same seed
        return isinstance(b, RandomProbe) and a.seed == b.seed
    return torch.equal(_outputs(a, role), _outputs(b, role))


def test_export_writes_the_champions_and_their_card(tmp_path, registry):
    import mlflow

    from semspec.models.project.probe_card import load_card_probe
    from semspec.tasks.probe_export import export_probes
    from semspec.tasks.probe_registry import load_probe

    out = export_probes(PAIR, tmp_path / "out" / "probes")
    assert sorted(p.name for p in out.iterdir()) == [
        "draft-all",
        "draft-random",
        CARD_FILE,
        "target-all",
        "target-random",
    ]  # `last` has no target champion: not exported by default
    assert sorted(p.name for p in out.parent.iterdir()) == ["probes"], "no temporary folder is left"
    card = read_card(out)
    assert card.pair == PAIR and card.variants == ["all", "random"]
    for variant in card.variants:
        for role in ROLES:
            ref, entry = registry[role, variant], card.probe(variant, role)
            assert entry.sha256 == ref.sha256 and entry.registry["version"] == ref.version
            assert entry.registry["name"] == f"semspec-{PAIR}-{role}-{variant}"
            assert (entry.model_id, entry.hidden_size, entry.format) == (
                MODEL_IDS[role],
                HIDDEN[role],
                "float32",
            )
            assert entry.model_sha256 == (TARGET_SHA if role == "target" else None)
            assert entry.routing == {"auroc": pytest.approx(0.61)} and entry.metrics["val_mse"] == 0.02
            mv = mlflow.MlflowClient().get_model_version(ref.name, ref.version)
            assert entry.tags == mv.tags and entry.description == f"{role} probe {variant}"
            assert entry.data_hash == {k: mv.tags[k] for k in ("samples_hash", "labels_hash", "source_hash")}
            original, _ = load_probe(PAIR, role, variant, MODEL_IDS[role], HIDDEN[role], fmt="float32")
            back, sha = load_card_probe(
                out, card, role, variant, MODEL_IDS[role], HIDDEN[role], fmt="float32"
            )
            assert sha == ref.sha256 and _same_probe(back, original, role)
    assert (
        registry["draft", "all"].version == "2" and card.probe("all", "draft").metrics["test_mse"] == 1.0123
    )
    assert card.floor("all", "min_ratio") == FLOORS["all"] and card.floor("random", "min_ratio") is None
    assert json.loads((out / CARD_FILE).read_text())["format_version"] == 1


def test_export_refuses_what_it_should_not_overwrite(tmp_path, registry):
    from semspec.tasks.probe_export import export_probes

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty: pass an empty or new folder, or --overwrite"):
        export_probes(PAIR, busy)
    with pytest.raises(ValueError, match=r"holds no semspec-probes\.json"):
        export_probes(PAIR, busy, overwrite=True)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match=rf"no registered probe semspec-{PAIR}-target-last@champion"):
        export_probes(PAIR, tmp_path / "last", ["last"])
    assert not (tmp_path / "last").exists() and not list(tmp_path.glob(".last*")), "nothing half-written"
    out = export_probes(PAIR, tmp_path / "again", ["all"])
    assert read_card(out).variants == ["all"]
    assert read_card(export_probes(PAIR, out, overwrite=True)).variants == ["all", "random"]


def test_import_into_an_empty_registry_loads_like_the_original(tmp_path, registry, monkeypatch):
    import mlflow

    from semspec.tasks.probe_export import export_probes
    from semspec.tasks.probe_import import import_probes
    from semspec.tasks.probe_registry import load_probe, registered_floor

    out = export_probes(PAIR, tmp_path / "probes")
    originals = {
        (r, v): load_probe(PAIR, r, v, MODEL_IDS[r], HIDDEN[r])[0] for r in ROLES for v in ("all", "random")
    }
    source_tags = {
        k: mlflow.MlflowClient().get_model_version(ref.name, ref.version).tags for k, ref in registry.items()
    }
    use_registry(monkeypatch, tmp_path / "b")
    assert mlflow.MlflowClient().search_registered_models() == []
    refs = import_probes(out)
    assert sorted(r.name for r in refs) == sorted(
        f"semspec-{PAIR}-{r}-{v}" for r in ROLES for v in ("all", "random")
    )
    client = mlflow.MlflowClient()
    for (role, variant), original in originals.items():
        probe, ref = load_probe(PAIR, role, variant, MODEL_IDS[role], HIDDEN[role], fmt="float32")
        assert ref.sha256 == registry[role, variant].sha256 and _same_probe(probe, original, role)
        assert client.get_model_version(ref.name, ref.version).tags == source_tags[role, variant]
        run = client.get_run(client.get_model_version(ref.name, ref.version).run_id)
        assert run.data.metrics["routing_auroc"] == pytest.approx(0.61)
    assert registered_floor(PAIR, "all") == FLOORS["all"]
    again = read_card(export_probes(PAIR, tmp_path / "again"))  # the imported probes export the same card
    first = read_card(out)
    for variant in first.variants:
        for role in ROLES:
            a, b = first.probe(variant, role), again.probe(variant, role)
            assert {**a.__dict__, "registry": None} == {**b.__dict__, "registry": None}


def test_import_refuses_a_card_for_other_models_before_registering(tmp_path, registry, monkeypatch):
    import mlflow

    from semspec.tasks.probe_export import export_probes
    from semspec.tasks.probe_import import import_probes

    out = export_probes(PAIR, tmp_path / "probes")
    use_project(monkeypatch, tmp_path / "other")
    write_pair(tmp_path / "other", draft_id="someone-else")
    use_registry(monkeypatch, tmp_path / "b")
    with pytest.raises(ValueError, match="trained on 'tiny-llama-0', and pair 'tp' has 'someone-else'"):
        import_probes(out)
    assert mlflow.MlflowClient().search_registered_models() == []


def test_decoders_from_a_folder(tmp_path, registry, monkeypatch):
    from semspec.models.project.pairs import load_pair
    from semspec.models.spec.settings import DecodeSettings
    from semspec.tasks.decoders import build_decoder, check_probes
    from semspec.tasks.probe_export import export_probes
    from tests.helpers.tiny import tiny_lm

    out = export_probes(PAIR, tmp_path / "probes")
    pair = load_pair(PAIR)
    lms = {
        "draft": tiny_lm(seed=0, hidden=HIDDEN["draft"]),
        "target": tiny_lm(seed=1, hidden=HIDDEN["target"]),
    }
    use_registry(monkeypatch, tmp_path / "empty")  # the folder alone: no registry holds these probes
    check_probes(pair, "all", out)
    with pytest.raises(ValueError, match=rf"no registered probe semspec-{PAIR}-draft-all@champion"):
        check_probes(pair, "all", None)
    with pytest.raises(ValueError, match="no probes of variant 'mix'"):
        check_probes(pair, "mix", out)
    dec = build_decoder("semanticspec", pair, lms, DecodeSettings(min_ratio="auto"), "all", probes_dir=out)
    assert dec.settings.min_ratio == FLOORS["all"]
    assert dec.probe_ids == {r: registry[r, "all"].sha256 for r in ROLES}
    card = read_card(out)
    from semspec.models.project.probe_card import load_card_probe

    for role, fn in (("draft", dec.q_probe), ("target", dec.p_probe)):
        probe, _ = load_card_probe(out, card, role, "all", MODEL_IDS[role], HIDDEN[role])
        torch.manual_seed(3)
        x = torch.randn(4, HIDDEN[role])
        assert torch.equal(fn.probe(x), probe(x))
    rnd = build_decoder("semanticspec", pair, lms, DecodeSettings(min_ratio="auto"), "random", probes_dir=out)
    assert rnd.settings.min_ratio is None  # Random keeps the paper's rule
    wrong = {"draft": lms["target"], "target": lms["draft"]}
    with pytest.raises(ValueError, match="was trained on 'tiny-llama-0', not on 'tiny-llama-1'"):
        build_decoder("semanticspec", pair, wrong, DecodeSettings(), "all", probes_dir=out)
    with pytest.raises(ValueError, match="pass one"):
        build_decoder("semanticspec", pair, lms, DecodeSettings(), "all", {"draft-all": "1"}, out)


def test_the_cli_exports_and_imports(tmp_path, registry, monkeypatch):
    from semspec.flows.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["probes", "export", "--pair", PAIR, str(tmp_path / "cli"), "--variant", "all"])
    assert res.exit_code == 0 and f"exported all of pair {PAIR}" in res.output, res.output
    res = runner.invoke(app, ["probes", "export", "--pair", PAIR, str(tmp_path / "cli")])
    assert res.exit_code == 2 and "--overwrite" in res.output
    use_registry(monkeypatch, tmp_path / "b")
    res = runner.invoke(app, ["probes", "import", str(tmp_path / "cli")])
    assert res.exit_code == 0 and f"registered semspec-{PAIR}-target-all v1" in res.output, res.output
    res = runner.invoke(app, ["probes", "import", str(tmp_path / "nowhere" / "x" / "y")])
    assert res.exit_code == 2 and "not a Hugging Face Hub repo id" in res.output
