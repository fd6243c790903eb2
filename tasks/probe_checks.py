"""What a shipped probe folder carries besides its card: float16 weights (``to_float16``: half the bytes;
the routing metrics are compared before shipping) and checks that CI replays without the models
(``write_checks`` / ``replay_checks``): per variant a fixed pair of held-out draft steps, one the target
shares and one it does not, with the features each role's probe reads and what the probes said of them.
A changed file, loader or probe class that would route those steps otherwise fails the replay."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from semspec.models.project.probe_card import ProbeCard, write_card
from semspec.models.project.probe_folder import read_card
from semspec.models.spec.names import ROLES
from semspec.models.spec.probe import WEIGHTS_FILE, load_probe_folder, sha256_of
from semspec.tasks.train.data import RoutingData

CHECKS_FILE = "checks.json"  # per variant: the two steps' shares, p, q and acceptance min(1, p/q)
FEATURES_FILE = "checks.safetensors"  # per variant and role: the two steps' features, (2, ...)
TOLERANCE = 1e-4  # a replayed probability may differ by float32 summation order only
KEEP = ("mu", "sigma")  # the standardisation stays float32 (a small sigma in float16 would move inputs)


def to_float16(folder: Path) -> None:
    """Store every probe's weights in ``folder`` (an export) as float16, their standardisation (``mu``,
    ``sigma``) kept in float32, and record the new files' sha256 in the card."""
    card = read_card(folder)
    probes = {}
    for variant in card.variants:
        probes[variant] = {}
        for role in ROLES:
            entry = card.probe(variant, role)
            path = folder / entry.path / WEIGHTS_FILE
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            tensors = load_file(str(path))  # name -> tensor
            half = {k: v.half() if v.is_floating_point() and k not in KEEP else v for k, v in tensors.items()}
            save_file(half, str(path), metadata=meta)
            probes[variant][role] = replace(entry, sha256=sha256_of(path))
    write_card(replace(card, probes=probes), folder)


def _probes(folder: Path, card: ProbeCard, variant: str) -> dict[str, torch.nn.Module]:
    return {
        role: load_probe_folder(folder / card.probe(variant, role).path, card.probe(variant, role).sha256)
        for role in ROLES
    }


@torch.inference_mode()
def _pq(
    probes: dict[str, torch.nn.Module], draft_x: np.ndarray, target_x: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(p, q): the target probe on the target's features, the draft probe on the draft's."""
    p = probes["target"](torch.from_numpy(target_x).float()).numpy()
    q = probes["draft"](torch.from_numpy(draft_x).float()).numpy()
    return p, q


def write_checks(folder: Path, data: RoutingData, test_questions: set[str]) -> dict[str, list[dict]]:
    """For every learned variant of the export in ``folder``: among the test questions' draft steps, the
    shared one the probes accept most readily and the unshared one they accept least, written with their
    features (``FEATURES_FILE``) and the probes' p, q and acceptance (``CHECKS_FILE``). Returns the checks."""
    card = read_card(folder)
    te = np.isin(data.question_id, sorted(test_questions))
    shared = data.share_target[te] > 0
    if shared.all() or not shared.any():
        raise ValueError("the test questions need shared and unshared draft steps to pick checks from")
    features, checks = {}, {}
    for variant in card.variants:
        if variant == "random" or variant not in data.q_x:
            continue
        qx, px = data.q_x[variant][te], data.p_x[variant][te]
        p, q = _pq(_probes(folder, card, variant), qx, px)
        accept = np.minimum(1.0, p / np.maximum(q, 1e-9))
        picks = [
            int(np.flatnonzero(shared)[np.argmax(accept[shared])]),
            int(np.flatnonzero(~shared)[np.argmin(accept[~shared])]),
        ]
        if not accept[picks[0]] > accept[picks[1]]:
            raise ValueError(
                f"the {variant} probes accept no shared test step more readily than every unshared one "
                f"(acceptance {accept[picks[0]]:.3f} against {accept[picks[1]]:.3f}): they do not judge, so "
                f"they have no checks to ship"
            )
        features[f"{variant}/draft"] = torch.from_numpy(np.ascontiguousarray(qx[picks])).float()
        features[f"{variant}/target"] = torch.from_numpy(np.ascontiguousarray(px[picks])).float()
        checks[variant] = [
            {"shared": bool(shared[i]), "p": float(p[i]), "q": float(q[i]), "accept": float(accept[i])}
            for i in picks
        ]
    save_file(features, str(folder / FEATURES_FILE))
    (folder / CHECKS_FILE).write_text(json.dumps(checks, indent=2) + "\n", encoding="utf-8")
    return checks


def replay_checks(folder: Path) -> dict[str, list[dict]]:
    """Run the probes of ``folder`` on its checks' features: ValueError where a probability moved by more
    than ``TOLERANCE`` or the shared step is no longer accepted more readily than the unshared one.
    Returns the checks with the replayed values (``p_now``, ``q_now``)."""
    card = read_card(folder)
    checks = json.loads((folder / CHECKS_FILE).read_text(encoding="utf-8"))
    features = load_file(str(folder / FEATURES_FILE))
    for variant, steps in checks.items():
        p, q = _pq(
            _probes(folder, card, variant),
            features[f"{variant}/draft"].numpy(),
            features[f"{variant}/target"].numpy(),
        )
        for step, pn, qn in zip(steps, p, q, strict=True):
            step["p_now"], step["q_now"] = float(pn), float(qn)
            if abs(pn - step["p"]) > TOLERANCE or abs(qn - step["q"]) > TOLERANCE:
                raise ValueError(
                    f"{folder}: the {variant} probes now give p={pn:.6f}, q={qn:.6f} for a check step "
                    f"recorded at p={step['p']:.6f}, q={step['q']:.6f}"
                )
        accept = [min(1.0, s["p_now"] / max(s["q_now"], 1e-9)) for s in steps]
        if not accept[0] > accept[1]:
            raise ValueError(
                f"{folder}: the {variant} probes no longer tell the shared check step from the other"
            )
    return checks
