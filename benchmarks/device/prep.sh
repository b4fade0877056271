# Source from the repository root on a lent GPU machine (the device tool), after carrying `.device`:
#   here: mkdir -p .device && echo /.device/ >> .git/info/exclude && cp ../shared/wheels/*.whl .device/ \
#         && tar -czf .device/cifar10-jpeg.tgz -C ../shared/data cifar10-jpeg
#   there: source benchmarks/device/prep.sh; cd /tmp/pkg
# Installs the carried wheels into /tmp/site, lays the package out as installed in /tmp/pkg (triaccel,
# triaccel.backends, triaccel.kernels, examples, benchmarks, tests), unpacks the data into /tmp/data.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/*.whl 2>/dev/null
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r triaccel /tmp/pkg/triaccel && cp -r backends /tmp/pkg/triaccel/backends \
  && cp -r kernels /tmp/pkg/triaccel/kernels && cp -r examples benchmarks tests /tmp/pkg/
[ -d /tmp/data/cifar10-jpeg ] || { mkdir -p /tmp/data && tar -xzf .device/cifar10-jpeg.tgz -C /tmp/data; }
# tests/conftest.py turns the Triton interpreter on for CPU runs; on the GPU the kernels compile
# The lent machine's torch cannot keep its bytecode beside its sources: without a writable cache every process
# compiled ~1650 modules from source (5.4-6.6 s under cProfile, most in the lazy torch._dynamo import that the
# first torch.optim.SGD(...) makes, inside every method's set-up; 2026-12-01, s45 call 2). A prefix lets the
# warm-up process write it once, as an installed machine has it (the machine also sets PYTHONDONTWRITEBYTECODE).
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
export PYTHONPATH=/tmp/site:/tmp/pkg XLA_PYTHON_CLIENT_PREALLOCATE=false TRIACCEL_CACHE=/tmp/tcache TRITON_INTERPRET=0
