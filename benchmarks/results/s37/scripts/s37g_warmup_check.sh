# (~1.5 min) demo_variants.sh with its warm-up process: two short torch runs; their data loading and setup should match.
O=$OUT; OUT=$O MODEL=resnet18 SEEDS=0 EPOCHS=1 LIMIT=60 bash benchmarks/device/torch_variants.sh \
  "a1=--method amp --batch 192 --train-subset 8192" "a2=--method amp --batch 192 --train-subset 8192" > $O/torch.log 2>&1
grep -v "^W1\|Warning" $O/torch.log | grep "acc\|wall_s\|rror\|warm-up" | head
cat $O/warmup.log | tail -n 3
