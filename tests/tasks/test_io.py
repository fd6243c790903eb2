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


def test_the_code_hash_of_a_package_covers_every_module_in_it(tmp_path, monkeypatch):
    """Shards record the md5 of the code that made them: a change in any module of a package (the LM's
    step loop, say) must change it, not only one in the package's __init__."""
    import importlib
    import sys

    from semspec.tasks.io import source_md5

    pkg = tmp_path / "somepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from somepkg.loop import step\n")
    (pkg / "loop.py").write_text("def step():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("somepkg")
    before = source_md5(module)
    (pkg / "loop.py").write_text("def step():\n    return 2\n")
    assert source_md5(module) != before
    (pkg / "loop.py").write_text("def step():\n    return 1\n")
    assert source_md5(module) == before
    for name in ("somepkg", "somepkg.loop"):
        sys.modules.pop(name, None)
