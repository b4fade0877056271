# Issue 18: the per-block curvature lever against none, ResNet-18 local-fresh alone (20 epochs per block,
# exits at the end), seeds 0 and 2, one after the other in one call (~5.5 min on an H100); the end-to-end
# runs of these seeds repeat to the digit between calls (87.46 / 87.58%, 2026-11-24), so they are not rerun.
#   bash benchmarks/device/curvature_ab.sh   (device tool, carry [".device"]; EVERY=5 epochs between measurements)
mkdir -p $OUT/keep
for s in ${SEEDS:-0 2}; do
  for v in off curv; do
    if [ $v = off ]; then L=""; else L="--block-curvature ${EVERY:-5}"; fi
    VARIANTS=local-fresh LARGS="$L" SEEDS=$s timeout 110 bash benchmarks/device/local_graphs.sh compare > /dev/null 2>&1
    for f in runs.tgz lve.log lve.json; do mv $OUT/$f $OUT/keep/$v-s$s-$f 2>/dev/null; done
    echo "== $v s$s"; grep "^local-fresh  *$s " $OUT/keep/$v-s$s-lve.log
    tar -czf $OUT/keep.tgz -C $OUT keep   # the device tool returns few files: one archive, refreshed per run
  done
done
rm -rf $OUT/keep
