# The JAX demo with a step in flight (--in-flight on, the default) and waiting for every step (off).
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; bash $R/benchmarks/device/jax_in_flight.sh ab|r18
#   ab:  EPOCHS (default 3) epochs, seed 0, AMP bs 384 and triaccel --levers precision at bs 384, each on and off (own compile caches)
#   r18: 10 epochs, seed SEED (default 0), cold: AMP bs 192 and triaccel from its defaults (--budget 4GiB), both
#        --in-flight on, then (unless PAIR=1) triaccel off
#   pad: 10 epochs, seed SEED: AMP bs 192 cold; triaccel defaults (--budget 4GiB) cold, then with --pad-floor largest
#        cold and warm (its cache again), then the defaults warm
#   ahead: 10 epochs, seed SEED, cold: triaccel from its defaults (--budget 4GiB) with --compile-ahead on, then after
#   top: 10 epochs, seed SEED, cold: AMP bs 192, triaccel (--budget 4GiB) with the ladder's top rung at 384
#        (--batch-max 384, pad floor 384), then with the top at 512 but small batches padded to 384 only
D=/tmp/data/cifar10-jpeg; mkdir -p /tmp/runs
one() { name=$1; shift; timeout 220 python3 -m examples.cifar.train --backend jax --model resnet18 --data $D --seed ${SEED:-0} --no-progress --compile-cache /tmp/cc/${CACHE:-$name} --out /tmp/runs/$name "$@" > $OUT/$name.log 2>&1; echo "$name rc $?"; cp /tmp/runs/$name/log.jsonl $OUT/$name.jsonl
  cp /tmp/runs/$name/summary.json $OUT/$name.json || return; python3 -c "
import json; s=json.load(open('/tmp/runs/$name/summary.json'))
print(f\"{'$name':<16} acc {s['final_acc']:.4f} train_s {s['train_seconds']:.1f} wall_s {s['wall_seconds']:.1f} epochs {[round(x, 2) for x in s['epoch_seconds']]} batch {s['final_batch']} late_ooms {s.get('late_ooms')} peak_GiB {s['peak_alloc_bytes'] / 2**30:.2f}\")"; }
case "$1" in
ab)
  for f in on off; do one amp384-$f --method amp --batch 384 --epochs ${EPOCHS:-3} --in-flight $f; done
  for f in on off; do one tri384-$f --method triaccel --levers precision --batch 384 --batch-max 384 --epochs ${EPOCHS:-3} --in-flight $f; done ;;
r18)
  one amp192-s${SEED:-0} --method amp --batch 192 --epochs 10 --in-flight on
  one tri-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10 --in-flight on
  [ "$PAIR" = 1 ] || one tri-off-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10 --in-flight off ;;
pad)
  one amp192-s${SEED:-0} --method amp --batch 192 --epochs 10
  one tri-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10
  one tri-pad-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10 --pad-floor largest
  CACHE=tri-pad-s${SEED:-0} one tri-pad-warm-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10 --pad-floor largest
  CACHE=tri-s${SEED:-0} one tri-warm-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10 ;;
top)
  one amp192-s${SEED:-0} --method amp --batch 192 --epochs 10
  one tri-max384-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10 --batch-max 384
  one tri-pad384-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10 --pad-floor 384 ;;
ahead)
  for m in on after; do one tri-$m-s${SEED:-0} --method triaccel --budget 4GiB --epochs 10 --compile-ahead $m; done ;;
esac
