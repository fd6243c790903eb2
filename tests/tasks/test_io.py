"""Atomic writes: an output is either its old content or its new content, never half of one."""

from __future__ import annotations

import errno

import pytest

from semspec.tasks.io import atomic_path, save_figure_atomic, write_json_atomic


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temp(tmp_path):
    target = write_json_atomic({"v": 1}, tmp_path / "metrics.json")
    with pytest.raises(OSError, match="No space left"), atomic_path(target) as tmp:
        tmp.write_text('{"v": 2, "half')
        raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_text(encoding="utf-8").replace(" ", "").replace("\n", "") == '{"v":1}'
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_figures_are_written_whole(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure_atomic(fig, tmp_path / "plot.png")
    plt.close(fig)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
