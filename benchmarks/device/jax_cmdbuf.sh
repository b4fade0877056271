# Issue 16/15: is the JAX step's host time per program call spent waiting for the previous program or
# enqueuing its kernels? The data-parallel probe (jax_dp_probe.py, host ms per part) with XLA's default
# command buffers and with more of the step in them (CUDA graphs: one launch for many kernels). If the
# host time per call falls with more command buffers, the calls were launch-bound, and one device
# gains too. FLAGS overrides the second setting; DEVICES (default "1 4") and LOOPS the probe's.
#   bash benchmarks/device/jax_cmdbuf.sh     (device tool, a 4-GPU kind, carry [".device"])
source benchmarks/device/prep.sh; cd /tmp/pkg
more=${FLAGS:---xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,COLLECTIVES --xla_gpu_graph_min_graph_size=1}
i=0
for flags in "" "$more"; do
  i=$((i + 1))
  mkdir -p $OUT/flags$i; echo "== XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" OUT=$OUT/flags$i timeout 280 python3 benchmarks/device/jax_dp_probe.py --per-device 1024 \
    --devices ${DEVICES:-1 4} --stats global --loops ${LOOPS:-fused split in-flight} --steps 30 \
    > $OUT/cmdbuf$i.log 2>&1
  echo "rc $?"; grep -v -i "warn\|delay kernel" $OUT/cmdbuf$i.log | tail -12
done
