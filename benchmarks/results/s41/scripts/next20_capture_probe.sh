# (next session, ~7 min, nvidia-h200, carry [".device"]; copy to .device/ first) GPU checks and probes, no demo runs:
# the ShapeGraphs tests (graphed training equals eager, all four capture variants incl. eager_first), the statistics
# tests of kernels="torch" (torch's segmented sums) against the kernel; what one CUDA-graph capture costs per batch
# size (warm-up 3 / 1 / eager x caches emptied / kept, fresh processes, both models); benchmarks/kernels.py (GPU and
# host time of kernels="torch" beside the Triton kernel). Each block has its own timeout so the last line packs
# whatever ran (run with timeout_s 560: 120 + 170 + 100 + 130 s).
O=$OUT; mkdir -p $O/cap; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_torch_shape_graphs.py tests/test_kernels_moments.py \
  "tests/test_torch_optimizer.py::test_torch_segmented_moments_train_as_the_kernel_path" > $O/cap/gpu_tests.log 2>&1
timeout 170 python3 benchmarks/device/capture_cost.py --model efficientnet_b0 --steps 10 --out $O/cap > $O/cap/efficientnet_b0.log 2>&1
timeout 100 python3 benchmarks/device/capture_cost.py --model resnet18 --steps 10 --out $O/cap > $O/cap/resnet18.log 2>&1
timeout 130 python3 benchmarks/kernels.py --no-jax --out $O/cap/kernels > $O/cap/kernels.log 2>&1
tail -3 $O/cap/gpu_tests.log
for m in efficientnet_b0 resnet18; do grep -v "^W1\|Warning" $O/cap/$m.log | tail -9; done
grep "impl=torch\|^FixedMoments out=  \|grad_moments list out=  \|_foreach_norm  \|summary resnet18" $O/cap/kernels.log | head -12
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
