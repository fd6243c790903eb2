"""Stages run as dvc.yaml defines them: tracked config -> dvc repro, anything else -> the stage command."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from semspec.flows.stages import (
    STAGES,
    StageFailed,
    StageRequest,
    plan_stage,
    run_stage,
    stage_command,
    stage_files,
    stage_option,
    tracked_config,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """dvc.yaml and params.yaml of the real project in a DVC-initialised folder."""
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    (tmp_path / ".dvc").mkdir()
    return tmp_path


def test_every_stage_command_is_the_cli_stage_with_the_pair_filled_in():
    for stage in STAGES:
        argv = stage_command(stage, "my-pair", "tiny", ROOT)
        assert argv[:2] == ["semspec", stage]
        assert not any("${" in a for a in argv)
        assert any("data/my-pair" in a or "eval/my-pair" in a for a in argv)


def test_cli_defaults_are_dvc_yaml_paths():
    # the out of one stage is the input of the next, with one spelling
    assert stage_option("ingest", "out", "p", "demo", ROOT) == stage_option(
        "sample", "prefixes", "p", "demo", ROOT
    )
    assert stage_option("sample", "out", "p", "demo", ROOT) == ROOT / "data/p/samples"
    assert stage_files("train", "metrics", "p", "demo", ROOT) == [ROOT / "reports/p/train_metrics.json"]
    assert stage_files("evaluate", "metrics", "p", "demo", ROOT) == [
        stage_option("evaluate", "metrics", "p", "demo", ROOT)
    ]
    with pytest.raises(ValueError, match="has no --nope"):
        stage_option("train", "nope", "p", "demo", ROOT)


def test_tracked_config_uses_dvc_repro_and_the_rest_runs_the_command(project: Path):
    pair, profile = tracked_config(project)
    assert plan_stage(StageRequest("sample", pair, profile, root=project)) == (
        "dvc",
        ["dvc", "repro", "--single-item", "sample"],
    )
    assert plan_stage(StageRequest("train", pair, profile, force=True, root=project))[1][-2:] == [
        "--force",
        "train",
    ]
    mode, argv = plan_stage(StageRequest("ingest", "other", profile, ("ingest.seed=3",), root=project))
    assert mode == "direct"
    assert argv[:2] == ["semspec", "ingest"] and "data/other/prefixes.parquet" in argv
    assert argv[-6:] == ["--pair", "other", "--profile", profile, "--set", "ingest.seed=3"]
    assert plan_stage(StageRequest("ingest", pair, "tiny", root=project))[0] == "direct"  # another profile
    assert (
        plan_stage(StageRequest("ingest", pair, profile, ("ingest.seed=3",), root=project))[0] == "direct"
    )  # overrides
    shutil.rmtree(project / ".dvc")
    assert plan_stage(StageRequest("ingest", pair, profile, root=project))[0] == "direct"  # not a DVC repo
    with pytest.raises(ValueError, match="unknown stage"):
        plan_stage(StageRequest("deploy", pair, profile, root=project))


def test_unknown_variable_in_dvc_yaml_is_an_error(tmp_path: Path):
    (tmp_path / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {"ingest": {"cmd": "semspec ingest ${model}"}}})
    )
    with pytest.raises(ValueError, match=r"\$\{model\}"):
        stage_command("ingest", "p", "demo", tmp_path)
    with pytest.raises(ValueError, match="no stage 'train'"):
        stage_command("train", "p", "demo", tmp_path)


def _script_project(tmp_path: Path, code: str) -> Path:
    cmd = f"{sys.executable} -c {code!r}"
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"ingest": {"cmd": cmd}}}))
    return tmp_path


def test_run_stage_streams_lines_and_splits_progress_redraws(tmp_path: Path):
    code = "import sys; print('one'); sys.stdout.write('10%\\r50%\\r100%\\n'); print(sys.argv[1:])"
    lines: list[str] = []
    run = run_stage(
        StageRequest("ingest", "p", "demo", root=_script_project(tmp_path, code)), on_line=lines.append
    )
    assert run.mode == "direct" and not run.skipped and run.seconds > 0
    assert lines[1:5] == ["one", "10%", "50%", "100%"]
    assert lines[5] == "['--pair', 'p', '--profile', 'demo']"


def test_failed_stage_raises_with_its_last_lines(tmp_path: Path):
    code = "import sys; print('loading'); print('boom: bad input'); sys.exit(3)"
    with pytest.raises(StageFailed, match="exit code 3") as e:
        run_stage(
            StageRequest("ingest", "p", "demo", root=_script_project(tmp_path, code)), on_line=lambda _: None
        )
    assert str(e.value).endswith("loading\nboom: bad input")
