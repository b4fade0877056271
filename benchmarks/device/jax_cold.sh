# cold/warm JAX runs, seed 0: AMP bs 192, triaccel with and without compile-ahead; each cold run on empty caches
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; bash $R/benchmarks/device/jax_cold.sh  (prints one line per run; summaries to $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/jax_run.sh"
run amp-cold /tmp/c_amp --method amp --batch 192
run tri-cold /tmp/c_tri --method triaccel --budget 4GiB
run tri-noahead-cold /tmp/c_noa --method triaccel --budget 4GiB --compile-ahead off
run tri-warm /tmp/c_tri --method triaccel --budget 4GiB
run tri-noahead-warm /tmp/c_noa --method triaccel --budget 4GiB --compile-ahead off
