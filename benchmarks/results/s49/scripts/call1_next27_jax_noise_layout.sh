# (next session, ~9 min, nvidia-h200, carry [".device"]; copy to .device/ first) #14/#15 JAX: the noise halves
# held per parameter array (default) or as one zero-padded vector (TriAccel(noise_layout="flat"), demo
# --noise-layout flat). On 2026-11-28 (s41 call D) EfficientNet-B0's jit(train_body) took 92.4 s with the halves,
# 76.5 s without (--levers precision), 77.6 s for AMP; on this machine's CPU the flat layout cut the wrapped
# update's fusions 1,872 -> 1,173 (936 without the halves) but neither its CPU compile time nor its CPU call time
# improved (the CPU is not the target). Here: the update alone (compile s, fusions, call ms on the GPU), then the
# demo's step compilation, cold, one epoch of 2,048 images. Run with timeout_s 590 (blocks 120 + 90 + 360 s).
O=$OUT; mkdir -p $O/nl; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 120 python3 benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --noise --noise-layouts arrays flat \
  --variants plain auto --calls 20 --out $O/nl > $O/nl/update_eff.log 2>&1
timeout 90 python3 benchmarks/jax_update_compile.py --model resnet18 --width 1 --noise --noise-layouts arrays flat \
  --variants plain auto --calls 20 --out $O/nl/r18 > $O/nl/update_r18.log 2>&1
cd $R
SUB="--train-subset 2048 --test-subset 1000"
OUT=$O/nl MODEL=efficientnet_b0 SEEDS=0 EPOCHS=1 LIMIT=170 timeout 360 bash benchmarks/device/jax_variants.sh \
  "tri=--method triaccel --budget 4GiB $SUB" "triflat=--method triaccel --budget 4GiB --noise-layout flat $SUB" > $O/nl/jax.log 2>&1
tail -5 $O/nl/update_eff.log; tail -5 $O/nl/update_r18.log
grep -v "^W1\|Warning" $O/nl/jax.log | grep "acc\|critical\|rror" | head -8
for f in $O/nl/s0/*.json; do python3 -c "
import json; s=json.load(open('$f')); c=s['compile_log']['total']
print('$f'.split('/')[-1], 'critical', c['critical']['seconds'], [t for t in c['critical']['top'] if 'body' in t[0]])"; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
