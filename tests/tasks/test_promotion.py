"""Champions by held-out routing: a train run's probes, or an imported folder's (``--if-better``, how
``scripts/setup`` installs the shipped probes), become champion only when they route better than the
registry's; a run that stayed behind still counts as trained for its config; ``semspec.load`` falls
back to the shipped folder when the registry has no champion."""

from __future__ import annotations

import mlflow
import pytest

from semspec.models.project.names import CHAMPION, registered_name
from semspec.models.spec.names import ROLES
from semspec.tasks.probe_registry import SCORE_TAG, beats, champion_score, routing_score
from tests.tasks.test_probe_export import PAIR, register, use_project, use_registry, write_pair


def _champion(variant: str = "all", role: str = "target") -> str:
    return str(
        mlflow.MlflowClient()
        .get_model_version_by_alias(registered_name(PAIR, role, variant), CHAMPION)
        .version
    )


def _scored(tmp_path, seed: int, ta: float, fa: float) -> dict[str, str]:
    """Both roles' ``all`` probes registered (champion as they come), their runs given routing metrics."""
    client, versions = mlflow.MlflowClient(), {}
    for role in ROLES:
        ref = register(tmp_path, role, "all", seed)
        run_id = client.get_model_version(ref.name, ref.version).run_id
        client.log_metric(run_id, "routing_true_accept", ta)
        client.log_metric(run_id, "routing_false_accept", fa)
        versions[role] = ref.version
    return versions


@pytest.fixture
def project(tmp_path, monkeypatch):
    use_project(monkeypatch, tmp_path / "project")
    write_pair(tmp_path / "project")
    use_registry(monkeypatch, tmp_path / "a")
    return tmp_path


def test_the_score_and_when_it_beats_a_champion():
    assert routing_score({"true_accept": 0.9, "false_accept": 0.25}) == pytest.approx(0.65)
    assert routing_score({"true_accept": 0.9, "false_accept": float("nan")}) is None
    assert routing_score(None) is None and routing_score({"auroc": 0.7}) is None
    assert beats(0.1, (False, None)) and beats(None, (True, None)) and beats(0.2, (True, None))
    assert beats(0.6, (True, 0.5)) and not beats(0.5, (True, 0.5)) and not beats(None, (True, 0.5))


def test_trained_probes_become_champion_only_when_they_route_better(project):
    from semspec.tasks.train.registry import promote_trained

    first = _scored(project, 0, 0.9, 0.2)
    pointers = {f"{r}-all": {"name": registered_name(PAIR, r, "all"), "version": v} for r, v in first.items()}
    assert promote_trained(PAIR, pointers, {"all": {"true_accept": 0.9, "false_accept": 0.2}}, "better")
    assert champion_score(PAIR, "all") == (True, pytest.approx(0.7))
    worse = _scored(project, 1, 0.6, 0.3)  # registered as champion by the helper: put the first one back
    for role, version in first.items():
        mlflow.MlflowClient().set_registered_model_alias(
            registered_name(PAIR, role, "all"), CHAMPION, version
        )
    pointers = {f"{r}-all": {"name": registered_name(PAIR, r, "all"), "version": v} for r, v in worse.items()}
    routing = {"all": {"true_accept": 0.6, "false_accept": 0.3}}
    assert promote_trained(PAIR, pointers, routing, "better") == {"all": False}
    assert _champion() == first["target"] and _champion(role="draft") == first["draft"]
    tags = (
        mlflow.MlflowClient().get_model_version(registered_name(PAIR, "target", "all"), worse["target"]).tags
    )
    assert float(tags[SCORE_TAG]) == pytest.approx(0.3)  # scored all the same, for the compare view
    assert promote_trained(PAIR, pointers, routing, "always") == {"all": True}
    assert _champion() == worse["target"]


def test_the_champion_is_judged_on_the_new_run_s_own_steps_where_it_can_read_them(project):
    from types import SimpleNamespace

    from semspec.tasks.train.registry import champion_probes, promote_trained

    first = _scored(project, 0, 0.9, 0.2)  # its own steps scored it 0.7
    pointers = {f"{r}-all": {"name": registered_name(PAIR, r, "all"), "version": v} for r, v in first.items()}
    promote_trained(PAIR, pointers, {"all": {"true_accept": 0.9, "false_accept": 0.2}}, "always")
    new = _scored(project, 1, 0.6, 0.1)
    for role, version in first.items():
        mlflow.MlflowClient().set_registered_model_alias(
            registered_name(PAIR, role, "all"), CHAMPION, version
        )
    pointers = {f"{r}-all": {"name": registered_name(PAIR, r, "all"), "version": v} for r, v in new.items()}
    steps = {"n_shared": 20, "n_not_shared": 20}
    routing = {
        "all": {"true_accept": 0.6, "false_accept": 0.1, **steps}
    }  # 0.5: below the champion's tag (0.7)
    same_steps = {
        "all": {"true_accept": 0.5, "false_accept": 0.2, **steps}
    }  # the champion on these steps: 0.3
    few = {"all": {"true_accept": 0.6, "false_accept": 0.1, "n_shared": 20, "n_not_shared": 4}}
    assert promote_trained(PAIR, pointers, few, "better", same_steps) == {"all": False}  # too few to judge
    assert _champion() == first["target"]
    assert promote_trained(PAIR, pointers, routing, "better", same_steps) == {"all": True}
    assert _champion() == new["target"]
    for role, version in first.items():
        mlflow.MlflowClient().set_registered_model_alias(
            registered_name(PAIR, role, "all"), CHAMPION, version
        )
    better_here = {"all": {"true_accept": 0.8, "false_accept": 0.1, **steps}}  # 0.7 on these steps: it stays
    assert promote_trained(PAIR, pointers, routing, "better", better_here) == {"all": False}
    assert _champion() == first["target"]

    def trained(model_ids, fmt="float32"):
        from tests.tasks.test_probe_export import HIDDEN

        pair = SimpleNamespace(name=PAIR, pooling="predict")
        return {
            (role, variant): SimpleNamespace(
                run=SimpleNamespace(pair=pair),
                data=SimpleNamespace(model_id=model_ids[role], hidden_size=HIDDEN[role], format=fmt),
            )
            for role in ROLES
            for variant in ("all", "last")
        }

    from tests.tasks.test_probe_export import MODEL_IDS

    held = champion_probes(trained(MODEL_IDS), "all")
    assert set(held) == set(ROLES)
    assert champion_probes(trained({**MODEL_IDS, "target": "another/model"}), "all") is None
    assert champion_probes(trained(MODEL_IDS, fmt="int4"), "all") is None  # other features: not compared
    assert champion_probes(trained(MODEL_IDS), "last") is None  # no champion


def test_import_if_better_keeps_a_better_champion_and_replaces_a_worse_one(project, monkeypatch):
    from semspec.tasks.probe_export import export_probes
    from semspec.tasks.probe_import import import_probes
    from semspec.tasks.train.registry import promote_trained

    _scored(project, 0, 0.9, 0.2)  # the shipped probes: score 0.7
    shipped = export_probes(PAIR, project / "shipped")
    use_registry(monkeypatch, project / "b")  # a user's registry whose champion routes better (0.8)
    mine = _scored(project, 3, 0.95, 0.15)
    pointers = {f"{r}-all": {"name": registered_name(PAIR, r, "all"), "version": v} for r, v in mine.items()}
    promote_trained(PAIR, pointers, {"all": {"true_accept": 0.95, "false_accept": 0.15}}, "always")
    assert import_probes(shipped, if_better=True) == []
    assert _champion() == mine["target"]
    use_registry(monkeypatch, project / "c")  # a fresh clone's empty registry: the shipped ones come in
    refs = import_probes(shipped, if_better=True)
    assert {r.name for r in refs} == {registered_name(PAIR, r, "all") for r in ROLES}
    assert champion_score(PAIR, "all") == (True, pytest.approx(0.7))
    assert import_probes(shipped, if_better=True) == []  # equal probes keep the champion: setup is idempotent


def test_a_config_whose_probes_stayed_behind_the_champion_is_trained(project):
    from semspec.tasks.retrain import champion_status

    old = _scored(project, 0, 0.9, 0.2)
    keys = {"config_hash": "cfg2"}
    assert champion_status(PAIR, list(ROLES), ["all"], keys).startswith("config changed")
    new = _scored(project, 1, 0.5, 0.4)
    client = mlflow.MlflowClient()
    for role in ROLES:  # the new config's probes, behind the old champion
        name = registered_name(PAIR, role, "all")
        client.set_model_version_tag(name, new[role], "config_hash", "cfg2")
        client.set_registered_model_alias(name, CHAMPION, old[role])
    assert champion_status(PAIR, list(ROLES), ["all"], keys) is None


def test_load_decodes_with_the_shipped_probes_when_the_registry_has_none(project, monkeypatch):
    from semspec.api import _champions_or_shipped
    from semspec.models.project.pairs import load_pair
    from semspec.tasks.probe_export import export_probes

    _scored(project, 0, 0.9, 0.2)
    pair = load_pair(PAIR)
    assert _champions_or_shipped(pair, "all") is None  # the registry's champions first
    shipped = export_probes(PAIR, project / "project" / "probes" / PAIR)
    use_registry(monkeypatch, project / "empty")
    assert _champions_or_shipped(pair, "all") == shipped
    with pytest.raises(ValueError, match=r"no registered probe .*-last@champion"):
        _champions_or_shipped(pair, "last")  # the shipped folder has no `last`: the registry's error


def test_reports_say_which_probes_decode(project, monkeypatch):
    from semspec.tasks.probe_export import export_probes
    from semspec.tasks.probe_import import import_probes
    from semspec.tasks.probe_registry import champion_origin

    _scored(project, 0, 0.9, 0.2)
    assert "trained in run" in champion_origin(PAIR, "all")
    shipped = export_probes(PAIR, project / "shipped")
    use_registry(monkeypatch, project / "fresh")
    import_probes(shipped, if_better=True)
    said = champion_origin(PAIR, "all")
    assert (
        said.startswith(f"semspec-{PAIR}-target-all v1, imported from {shipped}")
        and "routing score 0.7" in said
    )
