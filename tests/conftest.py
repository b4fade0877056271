import os

# Triton kernels run on CPU only in the interpreter, which must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The benchmark scripts (loaded by path in some tests) import their shared helpers as `_results`,
# which `python benchmarks/<name>.py` finds beside the script.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
