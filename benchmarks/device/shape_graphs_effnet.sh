# (device tool, nvidia-h200, carry [".device"]; run from the repository root; ran as .device/next8_torch_graphs.sh on 2026-11-28)
# torch EfficientNet-B0 seed 0 (~5 min): the ShapeGraphs GPU tests, then AMP bs 512 under --compile cudagraphs (the
# fastest static of 2026-11-28) and --compile graphs, triaccel --compile graphs and eager, one after another
R=$PWD
(source benchmarks/device/prep.sh; cd /tmp/pkg && timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_torch_shape_graphs.py) > $OUT/gputests.txt 2>&1
tail -3 $OUT/gputests.txt
MODEL=efficientnet_b0 SEEDS=${SEED:-0} LIMIT=150 bash benchmarks/device/torch_variants.sh \
  "amp512cg=--method amp --batch 512 --compile cudagraphs" "amp512g=--method amp --batch 512 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" "tri=--method triaccel --budget 4GiB" \
  "amp512gcl=--method amp --batch 512 --compile graphs --memory-format channels_last" > $OUT/torch.log 2>&1
grep -v "^W1\|Warning" $OUT/torch.log | grep "acc\|graphs\|Error\|error" | head -30
cd $OUT && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $OUT
