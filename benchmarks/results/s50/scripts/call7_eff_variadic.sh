# (~5 min, nvidia-h200, carry [".device"]; timeout_s 330)
# #14/#15 JAX EfficientNet-B0: the triaccel step's compilation on HEAD and with .device/variadic.patch (call 2: the
# update alone compiled 8.68 -> 7.22 s and ran 5.79 -> 4.92 ms with it; ResNet-18's whole step in call 4 moved within
# the noise). Cold, one epoch of 2,048 images, one run each.
O=$OUT; mkdir -p $O/ph; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
demo() { name=$1; shift; mkdir -p /tmp/ph_$name; TRIACCEL_CACHE=/tmp/ph_$name timeout 150 python3 -m examples.cifar.train --backend jax \
  --model efficientnet_b0 --epochs 1 --data $D --seed 0 --no-progress --train-subset 2048 --test-subset 1000 \
  --compile-cache /tmp/ph_$name/jax --out /tmp/runs/ph_$name "$@" > $O/ph/$name.txt 2>&1; cp /tmp/runs/ph_$name/summary.json $O/ph/$name-summary.json
  python3 -c "
import json; s=json.load(open('$O/ph/$name-summary.json')); c=s['compile_log']['total']
print('$name', 'critical %.2f' % c['critical']['seconds'], 'train_body %.2f' % [t[1] for t in c['critical']['top'] if t[0] == 'jit(train_body)'][0],
      'epoch1 %.2f' % s['epoch_seconds'][0], 'wall %.1f' % s['wall_seconds'])" >> $O/ph/table.txt 2>&1; }
demo tri --method triaccel --budget 4GiB
cd $R && patch -p1 < .device/variadic.patch && source benchmarks/device/prep.sh && cd /tmp/pkg
demo trivar --method triaccel --budget 4GiB
cat $O/ph/table.txt
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
