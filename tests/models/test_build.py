"""Building the CPU kernels: one build per (sources, flags, compiler), stale builds removed, the switch
``SEMSPEC_KERNELS`` picking the instruction set."""

from __future__ import annotations

import pytest

from semspec.models.cpu import build, int4_kernel, int8_kernel
from semspec.models.cpu.cpuinfo import cpu_info
from semspec.models.project.settings import Settings, reload_settings

CAN_BUILD = build.compiler() is not None and build.ISAS["AVX2"][1] <= cpu_info().flags
AVX2 = frozenset({"avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw"}
AVX512_BF16 = AVX512 | {"avx512vl", "avx512_bf16"}


@pytest.fixture
def switch(monkeypatch):
    def set_to(value: str) -> None:
        monkeypatch.setenv("SEMSPEC_KERNELS", value)
        reload_settings()

    yield set_to
    monkeypatch.delenv("SEMSPEC_KERNELS", raising=False)
    reload_settings()


def test_the_switch_picks_the_best_build_the_cpu_runs_among_those_it_allows(switch):
    switch("auto")
    assert (
        build.isa(AVX512_BF16, int8_kernel.ISAS) == "AVX512" and build.isa(AVX2, int8_kernel.ISAS) == "AVX2"
    )
    assert build.isa(AVX512_BF16, (int4_kernel.ISA,)) == "AVX512_BF16"
    assert build.isa(AVX512, (int4_kernel.ISA,)) is None, "int4's kernel needs AVX512_BF16"
    assert build.isa(frozenset({"sse4_2"}), int8_kernel.ISAS) is None
    switch("avx2")  # the AVX2 build on an AVX-512 CPU, to test or measure it; AVX-512-only kernels off
    assert build.isa(AVX512_BF16, int8_kernel.ISAS) == "AVX2"
    assert build.isa(AVX512_BF16, (int4_kernel.ISA,)) is None
    switch("avx512")
    assert build.isa(AVX2, int8_kernel.ISAS) is None, "a build the CPU cannot run is never picked"
    switch("off")
    assert build.isa(AVX512_BF16, int8_kernel.ISAS) is None and int8_kernel.int8_mm.__wrapped__() is None
    with pytest.raises(ValueError, match="SEMSPEC_KERNELS"):
        Settings.from_env({"SEMSPEC_KERNELS": "0"})


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C++ compiler and an AVX2 CPU")
def test_a_kernel_is_built_once_per_key_and_a_new_build_removes_the_old(tmp_path, monkeypatch):
    cxx = build.compiler()
    lib = build.build(cxx, tmp_path, "AVX2", "int8_mm", int8_kernel.SOURCE)
    stamp = lib.stat().st_mtime_ns
    assert build.build(cxx, tmp_path, "AVX2", "int8_mm", int8_kernel.SOURCE) == lib
    assert lib.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [lib.name, lib.name + ".sha256"]
    monkeypatch.setattr(build, "sources_digest", lambda: "another version of csrc/")
    new = build.build(cxx, tmp_path, "AVX2", "int8_mm", int8_kernel.SOURCE)
    assert new != lib, "another key"
    assert sorted(p.name for p in tmp_path.iterdir()) == [new.name, new.name + ".sha256"], (
        "the stale one gone"
    )


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C++ compiler and an AVX2 CPU")
def test_a_library_changed_after_its_build_is_rebuilt_and_a_shared_cache_refused(tmp_path):
    cxx = build.compiler()
    lib = build.build(cxx, tmp_path, "AVX2", "int8_mm", int8_kernel.SOURCE)
    good = lib.read_bytes()
    lib.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit flipped: not the library built here
    assert build.build(cxx, tmp_path, "AVX2", "int8_mm", int8_kernel.SOURCE) == lib
    assert lib.read_bytes() == good, "rebuilt"
    lib.chmod(0o777)  # writable by others
    build.build(cxx, tmp_path, "AVX2", "int8_mm", int8_kernel.SOURCE)
    assert lib.stat().st_mode & 0o022 == 0, "rebuilt private"
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match="writable by others"):
        build.build(cxx, shared, "AVX2", "int8_mm", int8_kernel.SOURCE)


def test_the_key_covers_every_source_the_kernels_include():
    names = {p.name for p in build.CSRC.iterdir()}
    assert {"simd.h", "int8.cpp", "int4.cpp", "attention.cpp", "layer.h"} <= names
    assert len(build.sources_digest()) == 64


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C++ compiler and an AVX2 CPU")
def test_a_broken_compiler_fails_with_its_message(tmp_path):
    with pytest.raises(RuntimeError, match="failed to build the int8_mm kernel"):
        build.build("false", tmp_path, "AVX2", "int8_mm", int8_kernel.SOURCE)
    assert not list(tmp_path.glob("*.so")) and not [p for p in tmp_path.iterdir() if p.is_dir()]
