"""gamma: auto: SemanticSpec's steps per round chosen from the probes' step acceptance on held-out steps."""

from __future__ import annotations

import pytest

from semspec.models.spec.settings import GAMMA_MAX, DecodeSettings, gamma_for
from semspec.tasks.decoders import resolve_auto


@pytest.mark.parametrize(
    "rate, gamma",
    [
        (None, 1),
        (0.0, 1),
        (0.4, 1),
        (0.7, 1),
        (0.75, 2),
        (0.8, 3),
        (0.84, 3),
        (0.9, 4),
        (1.0, GAMMA_MAX),
        (1.5, 1),
    ],
)
def test_the_longest_round_kept_whole_half_the_time(rate, gamma):
    """0.75 ** 2 = 0.56 but 0.75 ** 3 = 0.42; 0.8 ** 3 = 0.51; 0.9 ** 4 = 0.66 (capped at 4); a rate that
    is unknown or not a rate gives the paper's 1."""
    assert gamma_for(rate) == gamma


def test_auto_is_a_setting_and_other_words_are_refused():
    assert DecodeSettings(gamma="auto").gamma == "auto"
    for bad in ("many", 0, 1.5, True):
        with pytest.raises(ValueError, match="gamma must be a count >= 1 or 'auto'"):
            DecodeSettings(gamma=bad)


def test_auto_resolves_from_what_the_probes_carry():
    tags = {"accept_rate": 0.8, "min_ratio": 0.25}
    got = resolve_auto(DecodeSettings(gamma="auto", min_ratio="auto"), "all", tags.get)
    assert (got.gamma, got.min_ratio) == (3, 0.25)
    assert resolve_auto(DecodeSettings(gamma="auto"), "random", tags.get).gamma == 1, "Random: the paper's"
    assert resolve_auto(DecodeSettings(gamma="auto"), "all", {}.get).gamma == 1, "a probe without the tag"
    assert resolve_auto(DecodeSettings(gamma=2), "all", tags.get).gamma == 2, "a count is kept"
