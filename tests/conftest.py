import os

# Triton kernels run on CPU only in the interpreter, which must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# MKL (torch's CPU BLAS/LAPACK) picks code paths by CPU that need not give the same bits for the same
# inputs from one buffer to another; the bit-identical resume tests (tests/reliability/test_rel_resume.py)
# need its reproducible mode, which it reads at its first call. Without it a 2-core Xeon (2026-12-04)
# resumed torch fp32 3.7e-9 away from the uninterrupted run, also at code that had passed elsewhere.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

# The benchmark scripts (loaded by path in some tests) import their shared helpers as `_results`,
# which `python benchmarks/<name>.py` finds beside the script.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
