# (~3 min, nvidia-h200, carry [".device"]; timeout_s 300)
# #14/#15 JAX: call 1 found the wrapped EfficientNet-B0 update's compilation in its HLO passes (priority-fusion
# 3.1 s against 0.26 s) and in LLVM/ptxas (121 kernels against 70). .device/variadic.patch makes the per-array
# statistics one variadic reduce (sum, sumsq, nonfinite as one HLO reduce) instead of three reduces.
# 1. the update alone, EfficientNet-B0, with and without the noise halves, on HEAD then with the patch;
# 2. the ResNet-18 demo, cold, one epoch of 2,048 images, triaccel with the patch (call 1: train_body 22.9 s
#    on the critical path against AMP bs 192's 15.0 s).
O=$OUT; mkdir -p $O/ph; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
upd() { tag=$1; for nz in --noise ""; do n=${nz:+noise}; n=${n:-plainlever}
  timeout 60 python3 benchmarks/xla_compile_phases.py --name eff-$tag-$n --top 12 --out $O/ph -- \
    python3 benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 $nz --calls 10 --_one auto > $O/ph/$tag-$n.txt 2>&1
  python3 -c "
import json; d=json.load(open('$O/ph/xla_compile_phases-eff-$tag-$n.json')); r=json.loads(d['stdout_tail'].strip().splitlines()[-1])
L=d['labels']; g=lambda k: sum(v['s'] for l,v in L.items() if l.startswith(k) and 'jit__lambda' in l)
print('$tag $n', 'compile_s %.2f fusions %d call_ms %.2f' % (r['compile_s'], r['fusions'], r['call_ms']),
      'hlo %.2f backend %.2f ptx %.2f cubin %.2f prio %.2f' % (g('GpuCompiler::RunHloPasses'), g('GpuCompiler::RunBackend for'),
      g('NVPTXCompiler::CompileTargetBinary - CompileToPtx'), g('NVPTXCompiler::CompileTargetBinary - PtxToCubin'),
      L.get('HLO pass: priority-fusion', {}).get('s', 0)))" >> $O/ph/table.txt 2>&1; done; }
upd head
cd $R && patch -p1 < .device/variadic.patch && source benchmarks/device/prep.sh && cd /tmp/pkg
upd variadic
mkdir -p /tmp/ph_tri; TRIACCEL_CACHE=/tmp/ph_tri timeout 120 python3 benchmarks/xla_compile_phases.py --name r18-tri-variadic --top 30 \
  --out $O/ph -- python3 -m examples.cifar.train --backend jax --model resnet18 --epochs 1 --data $D --seed 0 --no-progress \
  --train-subset 2048 --test-subset 1000 --compile-cache /tmp/ph_tri/jax --out /tmp/runs/ph_tri --method triaccel --budget 4GiB \
  > $O/ph/tri.txt 2>&1; cp /tmp/runs/ph_tri/summary.json $O/ph/tri-summary.json
python3 -c "
import json; s=json.load(open('$O/ph/tri-summary.json')); c=s['compile_log']['total']
print('r18 tri variadic critical', c['critical']['seconds'], c['critical']['top'][:3])" >> $O/ph/table.txt 2>&1
cat $O/ph/table.txt; head -20 $O/ph/tri.txt | cut -c1-120
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
