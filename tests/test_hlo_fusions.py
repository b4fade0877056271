"""benchmarks/hlo_fusions.py: fusions of an optimized HLO dump counted by name and traced to their source
line, on a CPU dump of a small program made here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import hlo_fusions  # noqa: E402

PROGRAM = """import jax, jax.numpy as jnp
def f(x, y):
    a = jnp.sum(x * 2.0)
    b = jnp.tanh(y) + 1.0
    return a, b
jax.jit(f)(jnp.ones((8, 4)), jnp.ones(3))
"""


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("hlo")
    (d / "prog.py").write_text(PROGRAM)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_dump_to={d / 'dump'} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_f"}
    subprocess.run([sys.executable, str(d / "prog.py")], env=env, check=True, timeout=300)
    (path,) = [p for p in (d / "dump").iterdir() if p.name.endswith("after_optimizations.txt") and "jit_f" in p.name]
    return path


def test_fusions_are_counted_and_traced_to_their_line(dump, capsys):
    fs = hlo_fusions.fusions(dump)
    assert fs and all("." not in f.name.rsplit("_", 1)[-1] for f in fs)   # instruction numbers dropped
    reduce = [f for f in fs if f.op.endswith("reduce_sum")]
    assert reduce and reduce[0].source.endswith("prog.py:3 (f)")
    counts = hlo_fusions.main([str(dump), str(dump), "--show", reduce[0].name])
    assert len(counts) == 2 and counts[0] == counts[1] and sum(counts[0].values()) == len(fs)
    out = capsys.readouterr().out
    assert "by op and source line" in out and "prog.py:3 (f)" in out and "b - a" in out


def test_gpu_metadata_with_a_scheduling_name_is_traced(tmp_path):
    # a GPU dump writes scheduling_name between op_name and stack_frame_id (jax 0.11, H200)
    (tmp_path / "gpu.txt").write_text("""HloModule jit_step

FileNames
1 "/pkg/kernels/grad_moments.py"

FunctionNames
1 "sums"

FileLocations
1 {file_name_id=1 function_name_id=1 line=324 end_line=324 column=15 end_column=30}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

ENTRY %main.1 (p: f32[64,3,3,3]) -> bf16[64,3,3,3] {
  %input_transpose_fusion.40 = bf16[64,3,3,3]{3,2,1,0} fusion(%p), kind=kInput, calls=%fused_transpose.40, \
metadata={op_name="jit(step)/select_n" scheduling_name="input_transpose_fusion.40" stack_frame_id=1}, backend_config={}
}
""".replace("\\\n", ""))
    (f,) = hlo_fusions.fusions(tmp_path / "gpu.txt")
    assert (f.name, f.kind, f.op) == ("input_transpose_fusion", "kInput", "jit(step)/select_n")
    assert f.source == "/pkg/kernels/grad_moments.py:324 (sums)"


def test_bad_arguments_are_errors(dump):
    with pytest.raises(SystemExit):
        hlo_fusions.main([str(dump), str(dump), str(dump)])
    with pytest.raises(SystemExit):
        hlo_fusions.main([str(dump), "--top", "0"])
