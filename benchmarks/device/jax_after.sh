# cold JAX runs, seed 0, each on empty caches: AMP bs 192; triaccel with --compile-ahead on, after, and after with --pad-floor largest
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; bash $R/benchmarks/device/jax_after.sh  (prints one line per run; summaries to $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/jax_run.sh"
run amp-cold /tmp/c_amp --method amp --batch 192
run tri-on-cold /tmp/c_on --method triaccel --budget 4GiB
run tri-after-cold /tmp/c_after --method triaccel --budget 4GiB --compile-ahead after
run tri-after-pad-cold /tmp/c_apad --method triaccel --budget 4GiB --compile-ahead after --pad-floor largest
