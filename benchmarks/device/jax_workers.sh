# cold JAX runs, seed 0, each on empty caches: AMP bs 192; triaccel with 3 background compilations at once
# (--compile-workers 3), the same with --compile-ahead after, and a pad floor of 192 with 2 at once
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; bash $R/benchmarks/device/jax_workers.sh
source "$(dirname "${BASH_SOURCE[0]}")/jax_run.sh"
run amp-cold /tmp/w_amp --method amp --batch 192
run tri-w3-cold /tmp/w_3 --method triaccel --budget 4GiB --compile-workers 3
run tri-w3-after-cold /tmp/w_3a --method triaccel --budget 4GiB --compile-workers 3 --compile-ahead after
run tri-pad192-w2-cold /tmp/w_p2 --method triaccel --budget 4GiB --compile-workers 2 --pad-floor 192
