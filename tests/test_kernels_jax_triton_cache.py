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


class FakeKernel:
    def __init__(self, name, num_warps, num_ctas, shared_mem_bytes, binary, ttir, cc):
        self.fields = (name, num_warps, num_ctas, shared_mem_bytes, binary, ttir, cc)


def fake_with_kernels() -> tuple[types.SimpleNamespace, dict]:
    """A stand-in with jax-triton's kernel entry point: specialize (counted), compile, build."""
    jt, calls = fake_jax_triton()
    lib = jt.triton_lib
    counts = {"specialize": 0, "compile": calls}

    def get_or_create_triton_kernel(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps,
                                    num_stages, num_ctas, compute_capability, enable_fp_fusion, metaparams, dump):
        counts["specialize"] += 1   # where Triton 3.6 imports torch
        ttir = f"ttir of {fn.cache_key} {arg_dtypes} {sorted(metaparams.items())}"
        res = lib.compile_ttir_inplace(ttir, None, FakeOptions(num_warps or 4), compute_capability or 90, platform)
        attrs = {(i,): [["tt.divisibility", 16]] for i, d in enumerate(arg_dtypes) if d.startswith("*")}
        return FakeKernel(res.name, num_warps or 4, num_ctas, res.shared_mem_bytes, res.binary, ttir,
                          compute_capability or 90), attrs

    lib.get_or_create_triton_kernel = get_or_create_triton_kernel
    lib.triton_kernel_call_lib = types.SimpleNamespace(TritonKernel=FakeKernel, get_compute_capability=lambda d: 90)
    return jt, counts


def _kernel(jt, src="src-v1", meta=(("BLOCK", 128),)):
    fn = types.SimpleNamespace(cache_key=src)
    return jt.triton_lib.get_or_create_triton_kernel(None, "cuda", fn, ["*fp32", "i32"], [(1, "i32", 7)],
                                                    num_warps=None, num_stages=None, num_ctas=1,
                                                    compute_capability=None, enable_fp_fusion=True,
                                                    metaparams=dict(meta), dump=False)


def test_a_new_process_builds_the_kernel_from_disk_without_specializing(tmp_path):
    first, c1 = fake_with_kernels()
    C.install(first, tmp_path)
    k1, a1 = _kernel(first)
    assert c1["specialize"] == 1 and len(c1["compile"]) == 1

    second, c2 = fake_with_kernels()
    C.install(second, tmp_path)
    k2, a2 = _kernel(second)
    assert c2["specialize"] == 0 and c2["compile"] == []       # no specializer, no compiler
    assert k2.fields == k1.fields and a2 == a1 and ["tt.divisibility", 16] in a2[(0,)]


def test_kernel_key_follows_the_source_and_meta_parameters(tmp_path):
    first, _ = fake_with_kernels()
    C.install(first, tmp_path)
    _kernel(first)
    second, c2 = fake_with_kernels()
    C.install(second, tmp_path)
    _kernel(second, src="src-v2")                  # the kernel's source changed
    _kernel(second, meta=(("BLOCK", 256),))        # another specialisation
    assert c2["specialize"] == 2
