# Sourced by the s57 next scripts after `source benchmarks/device/prep.sh; cd /tmp/pkg` (~40 s, O set): where the
# wrapped EfficientNet-B0 update's Triton fusions come from (s56 call 2: 45 of them; the update compiles 6.45 s
# against plain SGD's 1.52 s on an H100). Writes $O/xla_flags*.txt (the XLA option names in jax 0.11's binaries naming
# triton / softmax / fusion), $O/triton_fusions.txt (the Triton fusions' op mix, two of them in full) and $O/hlo_fusions.txt
# (benchmarks/hlo_fusions.py: every fusion by name, and where the Triton ones come from), from an optimized HLO dump
# of `jax_update_compile.py --variants auto`.
# XLA_FLAGS=--help aborts part-way through its list: the option names are read from the binaries instead (jaxlib and
# the CUDA plugin; retired names that XLA still recognises to reject may be among them)
python3 -c "import jaxlib, os; print(os.path.dirname(jaxlib.__file__))" > $O/xla_flags.txt
python3 -c "import jax_plugins, os; [print(p) for p in jax_plugins.__path__]" >> $O/xla_flags.txt 2>/dev/null
find $(cat $O/xla_flags.txt) -name "*.so*" -exec grep -aoh "xla_gpu_[a-z0-9_]*" {} + | sort -u >> $O/xla_flags.txt
grep -i "triton\|softmax\|fusion" $O/xla_flags.txt > $O/xla_flags_triton.txt
echo "flags: $(grep -c xla_gpu $O/xla_flags.txt) xla_gpu names, triton/softmax/fusion: $(wc -l < $O/xla_flags_triton.txt)"; tr '\n' ' ' < $O/xla_flags_triton.txt; echo
rm -rf /tmp/dump; XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" timeout 60 python3 benchmarks/jax_update_compile.py \
  --model efficientnet_b0 --width 1 --variants auto --calls 3 --out $O/upd 2>&1 | tail -2
F=$(ls -S /tmp/dump/*after_optimizations.txt 2>/dev/null | head -1); echo "dump: $F"
[ -n "$F" ] && python3 - "$F" > $O/triton_fusions.txt <<'PY'
import re, sys, collections
text = open(sys.argv[1]).read()
comps = dict(re.findall(r"\n(%?[\w.\-]+) [^\n]*\{\n(.*?)\n\}", text, re.S))
calls = re.findall(r"fusion\([^\n]*calls=(%?[\w.\-]+)[^\n]*__triton", text)
print(len(calls), "triton fusions")
mix = collections.Counter()
for c in calls:
    ops = tuple(sorted(set(re.findall(r"= [\w\[\]{},0-9]+ ([a-z\-]+)\(", comps.get(c, "")))))
    mix[ops] += 1
for ops, n in mix.most_common(12):
    print(n, " ".join(ops))
for c in calls[:2]:
    print("----", c); print(comps.get(c, "")[:1500])
PY
head -20 $O/triton_fusions.txt
# where the fusions come from (op path, source line), by name: the table, then each name with "triton" in it
python3 benchmarks/hlo_fusions.py "$F" --top 40 > $O/hlo_fusions.txt 2>&1
for n in $(grep -o "[A-Za-z_.-]*triton[A-Za-z_.-]*" $O/hlo_fusions.txt | sort -u | head -5); do
  python3 benchmarks/hlo_fusions.py "$F" --show "$n" >> $O/hlo_fusions.txt 2>&1; done
