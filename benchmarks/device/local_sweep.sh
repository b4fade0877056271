# Issue 18: ResNet-18 local-fresh alone (20 epochs per block unless a variant says otherwise, exits at
# the end) under named sets of local options, for each seed, one run after another in one call (~80 s
# per run on an H100). End-to-end runs of a seed repeat to the digit between calls (87.46 / 87.43 /
# 87.58% for seeds 0 / 1 / 2, 2026-11-24), so a sweep compares against them and a chosen default is then
# confirmed beside end-to-end in one call (`local_graphs.sh compare`).
#   SEEDS="0 2" bash benchmarks/device/local_sweep.sh off= curv="--block-curvature 5" ep="--block-epochs 24,24,8"
#   (device tool, carry [".device"]; each argument is name=options, an empty options string the defaults;
#   KEEP=1 leaves the runs for a following invocation in the same call, whose archive then holds both)
mkdir -p $OUT/keep
for s in ${SEEDS:-0 2}; do
  for spec in "$@"; do
    v=${spec%%=*}; L=${spec#*=}
    VARIANTS=local-fresh LARGS="$L" SEEDS=$s timeout 130 bash benchmarks/device/local_graphs.sh compare > /dev/null 2>&1
    for f in runs.tgz lve.log lve.json; do mv $OUT/$f $OUT/keep/$v-s$s-$f 2>/dev/null; done
    echo "== $v s$s ($L)"; grep "^local-fresh  *$s" $OUT/keep/$v-s$s-lve.log | head -1
    tar -czf $OUT/keep.tgz -C $OUT keep   # the device tool returns few files: one archive, refreshed per run
  done
done
[ -n "$KEEP" ] || rm -rf $OUT/keep
