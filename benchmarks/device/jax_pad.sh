# cold JAX runs, seed 0: AMP bs 192, triaccel, triaccel --pad-floor largest, each on empty caches; then both triaccel runs warm
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; bash $R/benchmarks/device/jax_pad.sh  (prints one line per run; summaries to $OUT)
source "$(dirname "${BASH_SOURCE[0]}")/jax_run.sh"
run amp-cold /tmp/c_amp --method amp --batch 192
run tri-cold /tmp/c_tri --method triaccel --budget 4GiB
run tri-pad-cold /tmp/c_pad --method triaccel --budget 4GiB --pad-floor largest
run tri-pad-warm /tmp/c_pad --method triaccel --budget 4GiB --pad-floor largest
run tri-warm /tmp/c_tri --method triaccel --budget 4GiB
