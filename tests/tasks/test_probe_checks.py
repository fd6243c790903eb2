"""A shipped probe folder's float16 weights and its checks (``tasks/probe_checks.py``), on an exported
folder of tiny probes and synthetic held-out steps; and every folder that ships in ``probes/``: it loads,
fits its pair's file and replays its checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from semspec.models.project.pairs import load_pair, project_root
from semspec.models.project.probe_card import check_card
from semspec.models.project.probe_folder import SHIPPED_DIR, read_card
from semspec.models.spec.probe import WEIGHTS_FILE
from semspec.tasks.probe_checks import CHECKS_FILE, replay_checks, to_float16, write_checks
from semspec.tasks.train.data import RoutingData
from tests.helpers.serving import TinySpec, write_untrained_probes

SHIPPED = sorted(p.parent for p in (project_root() / SHIPPED_DIR).glob("*/semspec-probes.json"))


@pytest.fixture
def exported(tmp_path):
    llm = TinySpec()
    folder = write_untrained_probes(tmp_path / "probes", llm.pair, llm.lms["draft"], llm.lms["target"])
    rng = np.random.default_rng(0)
    n = 40
    dims = {role: llm.lms[role].hidden_size for role in ("draft", "target")}
    data = RoutingData(
        {"all": rng.normal(size=(n, dims["draft"])).astype(np.float32)},
        {"all": rng.normal(size=(n, dims["target"])).astype(np.float32)},
        rng.uniform(size=n),
        (np.arange(n) % 3 > 0).astype(float),  # two steps in three shared
        np.array([f"q{i % 10}" for i in range(n)]),
    )
    return folder, data


def test_checks_replay_and_catch_a_moved_probability(exported):
    folder, data = exported
    checks = write_checks(folder, data, {f"q{i}" for i in range(6)})
    assert [s["shared"] for s in checks["all"]] == [True, False]
    assert checks["all"][0]["accept"] > checks["all"][1]["accept"]
    replayed = replay_checks(folder)
    assert abs(replayed["all"][0]["p_now"] - checks["all"][0]["p"]) <= 1e-6
    stored = json.loads((folder / CHECKS_FILE).read_text())
    stored["all"][0]["p"] += 0.01  # as if the probe had changed
    (folder / CHECKS_FILE).write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="now give p="):
        replay_checks(folder)


def test_probes_that_do_not_judge_have_no_checks(exported):
    folder, data = exported
    data.p_x["all"][:] = 0.0  # every step the same to the target probe, so p is one value
    data.q_x["all"][:] = 0.0
    with pytest.raises(ValueError, match="they do not judge"):
        write_checks(folder, data, {f"q{i}" for i in range(6)})


def test_float16_halves_the_weights_and_the_card_follows(exported):
    folder, data = exported
    card = read_card(folder)
    weights = folder / card.probe("all", "target").path / WEIGHTS_FILE
    before = weights.stat().st_size
    to_float16(folder)
    assert weights.stat().st_size < 0.6 * before
    after = read_card(folder)  # the new sha256s: the probes load (a stale sha256 would be refused)
    assert after.probe("all", "target").sha256 != card.probe("all", "target").sha256
    write_checks(folder, data, {f"q{i}" for i in range(6)})
    replay_checks(folder)


@pytest.mark.parametrize("folder", SHIPPED, ids=[p.name for p in SHIPPED])
def test_a_shipped_folder_loads_fits_its_pair_and_routes_its_checks(folder):
    card = read_card(folder)
    pair = load_pair(card.pair)
    for variant in card.variants:
        check_card(card, pair, variant, check_format=False)  # the format is this CPU's: not checked here
    checks = replay_checks(folder)
    assert {"all", "last"} <= set(checks)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size <= 30 * 2**20, f"{folder} holds {size / 2**20:.1f} MB"
