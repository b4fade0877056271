# s46 call 5: is a new size's first-step cost (0.24-0.29 s EfficientNet-B0) per process or per thread?
O=$OUT; mkdir -p $O/cap; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 100 python3 benchmarks/device/capture_cost.py --model efficientnet_b0 --warmups eager --steps 10 --prewarm-thread --out $O/cap > $O/cap/eff-thread.log 2>&1
timeout 100 python3 benchmarks/device/capture_cost.py --model efficientnet_b0 --warmups eager --steps 10 --out $O/cap/plain > $O/cap/eff-plain.log 2>&1
cat $O/cap/eff-thread.log $O/cap/eff-plain.log | grep -v "^W1\|Warning" | tail -12
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
