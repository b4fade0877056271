# s46 call 4: where one CUDA-graph capture's 0.3-0.45 s goes (EfficientNet-B0, ResNet-18), capture_cost.py --phases
O=$OUT; mkdir -p $O/cap; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 150 python3 benchmarks/device/capture_cost.py --model efficientnet_b0 --warmups eager 3 --steps 10 --phases --out $O/cap > $O/cap/eff.log 2>&1
timeout 90 python3 benchmarks/device/capture_cost.py --model resnet18 --warmups eager --steps 10 --phases --out $O/cap > $O/cap/r18.log 2>&1
cat $O/cap/eff.log $O/cap/r18.log | grep -v "^W1\|Warning" | tail -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
