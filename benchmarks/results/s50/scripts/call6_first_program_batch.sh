# (~2 min, nvidia-h200, carry [".device"]; timeout_s 240)
# #14 JAX ResNet-18: is triaccel's first-step compilation (call 4: 12.85 s against AMP bs 192's 9.68 s) the wrapper or
# the program's batch (triaccel's first program is the bs-512 one, the pad floor)? Cold, one epoch of 2,048 images,
# XLA's timers: AMP bs 192, AMP bs 512, triaccel.
O=$OUT; mkdir -p $O/ph; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
demo() { name=$1; shift; mkdir -p /tmp/ph_$name; TRIACCEL_CACHE=/tmp/ph_$name timeout 70 python3 benchmarks/xla_compile_phases.py \
  --name r18-$name --top 12 --out $O/ph -- python3 -m examples.cifar.train --backend jax --model resnet18 --epochs 1 --data $D \
  --seed 0 --no-progress --train-subset 2048 --test-subset 1000 --compile-cache /tmp/ph_$name/jax --out /tmp/runs/ph_$name "$@" \
  > $O/ph/$name.txt 2>&1; cp /tmp/runs/ph_$name/summary.json $O/ph/$name-summary.json 2>/dev/null
  python3 -c "
import json; s=json.load(open('$O/ph/$name-summary.json')); c=s['compile_log']['total']
L=json.load(open('$O/ph/xla_compile_phases-r18-$name.json'))['labels']; g=lambda k: L.get(k, {}).get('s', 0)
print('$name', 'critical %.2f' % c['critical']['seconds'], 'train_body %.2f' % [t[1] for t in c['critical']['top'] if t[0] == 'jit(train_body)'][0],
      'hlo %.2f backend %.2f config-assigner %.2f priority-fusion %.2f' % (g('GpuCompiler::RunHloPasses for jit_train_body'),
      g('GpuCompiler::RunBackend for jit_train_body'), g('HLO pass: config-assigner'), g('HLO pass: priority-fusion')))" >> $O/ph/table.txt 2>&1; }
demo amp192 --method amp --batch 192
demo amp512 --method amp --batch 512
demo tri --method triaccel --budget 4GiB
demo amp192b --method amp --batch 192
cat $O/ph/table.txt
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
