import os

# Triton kernels run on CPU only in the interpreter, which must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
