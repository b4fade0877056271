# (session 41, ~1 min) which ShapeGraphs variant fails on the GPU (s41a: autocast, warmup 0, eager_first 1, caches kept:
# "operation would make the legacy stream depend on a capturing blocking stream"), the CUDA moments test.
O=$OUT; mkdir -p $O/t; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 200 python3 -m pytest -q -p no:cacheprovider -rA tests/test_torch_shape_graphs.py "tests/test_kernels_moments.py" -k "cuda or graphed" > $O/t/gpu_tests.log 2>&1
grep "PASSED\|FAILED\|passed\|failed" $O/t/gpu_tests.log | tail -14
