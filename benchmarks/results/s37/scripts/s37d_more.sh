# (~5 min) #14: torch ResNet-18 seed 1, AMP bs 192 against triaccel, both --compile graphs, with the summary's setup /
# evaluation / plot seconds. #15: 6 interleaved rounds of JAX AMP against triaccel-fixed at bs 96 (3 epochs each).
R=$PWD; O=$OUT; mkdir -p $O/r18 $O/ab
OUT=$O/r18 MODEL=resnet18 SEEDS=1 LIMIT=80 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trig2=--method triaccel --budget 4GiB --compile graphs" > $O/r18/torch.log 2>&1
grep -v "^W1\|Warning" $O/r18/torch.log | grep "acc\|graphs\|wall_s\|rror" | head -20
grep -h "plots (" $O/r18/s1/*.log
cd $R && source benchmarks/device/prep.sh && cd /tmp/pkg
OUT=$O/ab MODEL=resnet18 BATCH=96 ROUNDS=6 EPOCHS=3 LIMIT=150 bash $R/benchmarks/device/jax_step_ab.sh > $O/ab.log 2>&1
grep -E "^(amp|tri)-r[0-9] +acc" $O/ab.log
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
