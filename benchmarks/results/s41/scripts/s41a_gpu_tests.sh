# (session 41, ~3 min) the GPU tests the s40 probe's collection error skipped: ShapeGraphs (eager_first incl.),
# kernels="torch" on CUDA without a host sync, the segmented optimizer parity (CPU tensors, interpreter).
O=$OUT; mkdir -p $O/t; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_torch_shape_graphs.py "tests/test_kernels_moments.py" -k "cuda or graph or Graph" > $O/t/gpu_tests.log 2>&1
TRITON_INTERPRET=1 timeout 100 python3 -m pytest -q -p no:cacheprovider "tests/test_torch_optimizer.py::test_torch_segmented_moments_train_as_the_kernel_path" > $O/t/seg.log 2>&1
tail -4 $O/t/gpu_tests.log; tail -2 $O/t/seg.log
