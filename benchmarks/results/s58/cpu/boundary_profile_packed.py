"""The JAX demo's control boundary on the CPU with the state packed as on an accelerator (SplitStep's
pack="auto" packs only off the CPU): benchmarks/device/jax_boundary_profile.py with SplitStep's `pack`
forced to True, so that the boundary's host work on the packed state (take/put of the fields it reads and
writes) shows in the profile. As run (2026-12-08), from the repository root:

    PYTHONPATH=$PWD python3 benchmarks/results/s58/cpu/boundary_profile_packed.py [pack] -- <demo options>

pack: "on" (default) or "auto" (the demo as it is on a CPU: unpacked)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks" / "device"))
from triaccel.backends.jax import split_step  # noqa: E402

mode = sys.argv.pop(1) if len(sys.argv) > 1 and sys.argv[1] in ("on", "auto") else "on"
if mode == "on":
    init = split_step.SplitStep.__init__

    def packed_init(self, *a, **k):
        k["pack"] = True
        init(self, *a, **k)

    split_step.SplitStep.__init__ = packed_init

import jax_boundary_profile  # noqa: E402

jax_boundary_profile.main()
