# (a later session, ~4 min, nvidia-h200, carry [".device"]; optional) #14/#15 JAX: what packing the state costs in
# XLA compilation and saves per call on the GPU, the plain SGD step against the TriAccel-wrapped one (on this
# project's 2-core CPU, ResNet-18 width 0.25 bs 32: packing +2.1 s / +2.0 s of first call, 2026-11-28).
O=$OUT; mkdir -p $O/jp; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
for m in resnet18 efficientnet_b0; do for u in plain triaccel; do
  timeout 110 python3 benchmarks/jax_packing.py --model $m --width 1 --batch 96 --steps 20 --update $u --out $O/jp \
    > $O/jp/$m-$u.log 2>&1; tail -4 $O/jp/$m-$u.log; done; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
