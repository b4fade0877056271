# (~7 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 590)
# #14/#15 JAX EfficientNet-B0: the wrapped update alone compiles in 14.0 s against plain SGD's 1.4 s with
# only 49 more fusions (call 1): newer XLA autotunes every reduction and transpose fusion between its native
# and its Triton block-level emitter (xla_gpu_experimental_enable_fusion_autotuner), and the wrapper's
# per-array moments are reductions. The update with and without that autotuning; then the demo's step
# compilation, cold, one epoch of 2,048 images: triaccel without and with it, AMP bs 512 with it.
O=$OUT; mkdir -p $O/fa; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
FA=xla_gpu_experimental_enable_fusion_autotuner=false
for opt in "" "--xla-option=$FA"; do
  timeout 120 python3 benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --noise --variants plain auto \
    --calls 20 --out $O/fa/upd${opt:+-fa} $opt > $O/fa/update_eff${opt:+-fa}.log 2>&1; tail -4 $O/fa/update_eff${opt:+-fa}.log
done
cd $R
SUB="--train-subset 2048 --test-subset 1000"
OUT=$O/fa MODEL=efficientnet_b0 SEEDS=0 EPOCHS=1 LIMIT=170 timeout 420 bash benchmarks/device/jax_variants.sh \
  "trifa=--method triaccel --budget 4GiB $SUB --xla-option $FA" "ampfa=--method amp --batch 512 $SUB --xla-option $FA" \
  "tri=--method triaccel --budget 4GiB $SUB" > $O/fa/jax.log 2>&1
grep -v "^W1\|Warning" $O/fa/jax.log | grep "acc\|critical\|rror" | head -12
for f in $O/fa/s0/*.json; do python3 -c "
import json; s=json.load(open('$f')); c=s['compile_log']['total']
print('$f'.split('/')[-1], 'critical', c['critical']['seconds'], [t for t in c['critical']['top'] if 'body' in t[0]], 'epoch_s', s['epoch_seconds'])"; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
