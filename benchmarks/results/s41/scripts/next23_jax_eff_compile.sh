# (next session, ~7 min, nvidia-h200, carry [".device"]) #14/#15 JAX EfficientNet-B0: where triaccel's extra step
# compilation goes (GPU, seed 0, s39 call D: jit(train_body) 108.4 s against AMP bs 512's 80.6 s on the critical
# path). Cold, one epoch of 2048 images (the compile log is what is read): AMP bs 512; triaccel's default (in-update
# noise halves: the batch lever); --levers precision (no noise halves in the update). On this machine's CPU
# (2026-11-28 ~14:05Z, bs 96, --compile-cache off, one run each): train_body 9.1 s AMP, 25.8 s triaccel, 15.5 s
# precision only, 29.1 s batch only. Run with timeout_s 560 (block 530 s).
O=$OUT; mkdir -p $O/jc; date -u
SUB="--train-subset 2048 --test-subset 1000"
OUT=$O/jc MODEL=efficientnet_b0 SEEDS=0 EPOCHS=1 LIMIT=170 timeout 530 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512 $SUB" "tri=--method triaccel --budget 4GiB $SUB" \
  "triprec=--method triaccel --budget 4GiB --levers precision $SUB" > $O/jax.log 2>&1
echo "== jax compile"; grep -v "^W1\|Warning" $O/jax.log | grep "acc\|critical\|rror" | head -12
for f in $O/jc/s0/*.json; do python3 -c "
import json,sys; s=json.load(open('$f')); c=s['compile_log']['total']
print('$f'.split('/')[-1], 'critical', c['critical']['seconds'], [t for t in c['critical']['top'] if 'body' in t[0]], 'background', c['background']['seconds'], [t for t in c['background']['top'] if 'body' in t[0]])"; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
