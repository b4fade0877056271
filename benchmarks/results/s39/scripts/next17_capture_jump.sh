# (next session, ~7 min, nvidia-h200, carry [".device"]; copy to .device/ first) #14 EfficientNet-B0: what a
# CUDA-graph capture costs (warm-up passes 1 / 3, torch's cache emptying kept / made a no-op), then
# batch_growth=jump against the default rung climb (c = 2), AMP bs 512 beside, seeds 0-1, every run cold.
# First the ShapeGraphs GPU tests (graphed training equals eager, also with warm-up 1 and caches kept).
# Each block has its own timeout so that the last line packs whatever ran (run with timeout_s 600: blocks 90 + 2 x 90 + 300 s).
O=$OUT; mkdir -p $O/cap $O/eff; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_torch_shape_graphs.py > $O/cap/shape_graphs_tests.log 2>&1
for m in efficientnet_b0 resnet18; do
  timeout 90 python3 benchmarks/device/capture_cost.py --model $m --out $O/cap > $O/cap/$m.log 2>&1; done
cd $R
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=100 timeout 300 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trij=--method triaccel --budget 4GiB --compile graphs --set batch_growth=jump" > $O/eff/torch.log 2>&1
tail -3 $O/cap/shape_graphs_tests.log
for m in efficientnet_b0 resnet18; do grep -v "^W1\|Warning" $O/cap/$m.log | tail -8; done
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror\|warm-up\|graphs" | head -24
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
