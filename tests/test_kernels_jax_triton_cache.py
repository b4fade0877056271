"""The disk cache in front of jax-triton's kernel compile step, over a stand-in module (jax-triton
itself cannot be imported without a GPU; the GPU machine's runs use the real one)."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

pytest.importorskip("triton")

from triaccel.kernels import jax_triton_cache as C  # noqa: E402


@dataclasses.dataclass
class FakeResult:
    binary: str
    name: str
    shared_mem_bytes: int
    ttgir: str | None
    llir: str | None


@dataclasses.dataclass(frozen=True)
class FakeOptions:
    num_warps: int = 4
    debug: bool = False


def fake_jax_triton() -> tuple[types.SimpleNamespace, list]:
    calls: list = []

    def compile_ttir_inplace(ttir, backend, options, cc, platform):
        calls.append((str(ttir), options, cc, platform))
        return FakeResult(binary=f"ptx of {ttir} w{options.num_warps} sm{cc}", name="k", shared_mem_bytes=128,
                          ttgir=None, llir=None)

    lib = types.SimpleNamespace(compile_ttir_inplace=compile_ttir_inplace, CompilationResult=FakeResult)
    return types.SimpleNamespace(triton_lib=lib, __version__="0.test"), calls


def test_second_process_reads_the_compilation_from_disk(tmp_path):
    first, calls1 = fake_jax_triton()
    assert C.install(first, tmp_path)
    r1 = first.triton_lib.compile_ttir_inplace("module A", None, FakeOptions(), 90, "cuda")
    assert len(calls1) == 1 and len(list(tmp_path.glob("*.json"))) == 1

    second, calls2 = fake_jax_triton()   # a new process: empty memory, same disk
    assert C.install(second, tmp_path)
    r2 = second.triton_lib.compile_ttir_inplace("module A", None, FakeOptions(), 90, "cuda")
    assert calls2 == [] and r2 == r1


@pytest.mark.parametrize("change", [
    dict(ttir="module B"), dict(options=FakeOptions(num_warps=8)), dict(cc=80), dict(platform="rocm")])
def test_any_input_of_the_compilation_changes_the_key(tmp_path, change):
    jt, calls = fake_jax_triton()
    C.install(jt, tmp_path)
    base = dict(ttir="module A", options=FakeOptions(), cc=90, platform="cuda")
    jt.triton_lib.compile_ttir_inplace(base["ttir"], None, base["options"], base["cc"], base["platform"])
    args = {**base, **change}
    out = jt.triton_lib.compile_ttir_inplace(args["ttir"], None, args["options"], args["cc"], args["platform"])
    assert len(calls) == 2 and out.binary == f"ptx of {args['ttir']} w{args['options'].num_warps} sm{args['cc']}"


def test_unreadable_entry_is_compiled_again_and_rewritten(tmp_path):
    jt, calls = fake_jax_triton()
    C.install(jt, tmp_path)
    jt.triton_lib.compile_ttir_inplace("module A", None, FakeOptions(), 90, "cuda")
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{truncated")
    again, calls2 = fake_jax_triton()
    C.install(again, tmp_path)
    r = again.triton_lib.compile_ttir_inplace("module A", None, FakeOptions(), 90, "cuda")
    assert len(calls2) == 1 and json.loads(entry.read_text())["binary"] == r.binary


def test_debug_compiles_bypass_the_cache_and_install_is_idempotent(tmp_path):
    jt, calls = fake_jax_triton()
    assert C.install(jt, tmp_path) and C.install(jt, tmp_path)   # wrapped once, not twice
    for _ in range(2):
        jt.triton_lib.compile_ttir_inplace("module A", None, FakeOptions(debug=True), 90, "cuda")
    assert len(calls) == 2 and not list(tmp_path.glob("*.json"))


def test_switched_off_or_unknown_layout_leaves_jax_triton_alone(tmp_path, monkeypatch):
    jt, _ = fake_jax_triton()
    original = jt.triton_lib.compile_ttir_inplace
    monkeypatch.setenv(C.ENV_SWITCH, "0")
    assert not C.install(jt, tmp_path) and jt.triton_lib.compile_ttir_inplace is original
    monkeypatch.delenv(C.ENV_SWITCH)
    other = types.SimpleNamespace(triton_lib=types.SimpleNamespace())   # another jax-triton version
    assert not C.install(other, tmp_path)


def test_default_folder_follows_triaccel_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRIACCEL_CACHE", str(tmp_path))
    assert C.default_folder() == tmp_path / "jax-triton"
