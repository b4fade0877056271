# (next session, ~5 min, nvidia-h200, carry [".device"]; copy to .device/ first) #14: what one CUDA-graph capture
# costs per batch size, in fresh processes, for warm-up 3 (torch's recipe) / 1 / eager (ShapeGraphs(eager_first=1,
# warmup=0)) x caches emptied / kept, both models; first the ShapeGraphs GPU tests (graphed training equals
# eager, all four capture variants). Each block has its own timeout so that the last line packs whatever ran
# (run with timeout_s 420: 90 + 180 + 120 s).
O=$OUT; mkdir -p $O/cap; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_torch_shape_graphs.py > $O/cap/shape_graphs_tests.log 2>&1
timeout 180 python3 benchmarks/device/capture_cost.py --model efficientnet_b0 --steps 10 --out $O/cap > $O/cap/efficientnet_b0.log 2>&1
timeout 120 python3 benchmarks/device/capture_cost.py --model resnet18 --steps 10 --out $O/cap > $O/cap/resnet18.log 2>&1
tail -3 $O/cap/shape_graphs_tests.log
for m in efficientnet_b0 resnet18; do grep -v "^W1\|Warning" $O/cap/$m.log | tail -9; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
