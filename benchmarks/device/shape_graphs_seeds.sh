# (device tool, nvidia-h200, carry [".device"]; run from the repository root; ran as .device/next9_graphs_seeds.sh on 2026-11-28)
# ShapeGraphs (--compile graphs), noise halves graphed too: EfficientNet-B0 seed 0 triaccel again, seeds 1-2 AMP bs 512
# against triaccel; ResNet-18 seed 0: AMP bs 384 eager and graphed (the fastest static eligible by accuracy is bs
# 192: run beside it on the same machine, see docs/results.md), triaccel eager and graphed
O=$OUT
(source benchmarks/device/prep.sh; cd /tmp/pkg && timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_torch_shape_graphs.py) > $O/gputests.txt 2>&1
tail -1 $O/gputests.txt
mkdir -p $O/eff0 $O/eff12 $O/r18
OUT=$O/eff0 MODEL=efficientnet_b0 SEEDS=0 LIMIT=100 bash benchmarks/device/torch_variants.sh \
  "trig2=--method triaccel --budget 4GiB --compile graphs" > $O/eff0/torch.log 2>&1
OUT=$O/eff12 MODEL=efficientnet_b0 SEEDS="1 2" LIMIT=100 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" "trig2=--method triaccel --budget 4GiB --compile graphs" > $O/eff12/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS=0 LIMIT=100 bash benchmarks/device/torch_variants.sh \
  "amp384=--method amp --batch 384" "amp384g=--method amp --batch 384 --compile graphs" \
  "tri=--method triaccel --budget 4GiB" "trig2=--method triaccel --budget 4GiB --compile graphs" > $O/r18/torch.log 2>&1
for d in eff0 eff12 r18; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/torch.log | grep "acc\|graphs\|Error\|rror" | head -20; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
