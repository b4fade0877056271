import json, sys
from pathlib import Path
sys.path.insert(0, "/work/main")
from examples.cifar import train
DATA = "/work/shared/data/cifar10-jpeg"
for mode in ("on", "off"):
    out = Path(f"/tmp/s58cpu/seq_{mode}")
    args = ["--data", DATA, "--epochs", "1", "--train-subset", "192", "--test-subset", "64", "--batch", "32",
            "--width", "0.125", "--t-ctrl", "2", "--warmup-steps", "2", "--no-progress", "--device", "cpu",
            "--out", str(out), "--backend", "jax", "--method", "triaccel", "--budget", "4GiB", "--batch-max", "32",
            "--set", "noise_beta=0", "--set", "min_dwell=0", "--fused-step", mode]
    s = train.run(train.parse_args(args))
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    print(mode, s["noise_in_update"], s["report"]["noise_measurements"])
    print(" steps", [(r["step"], r["samples"], round(r["loss"], 5)) for r in rows if r["type"] == "step"])
    print(" dec", [(r["step"], r["b_noise"]) for r in rows if r["type"] == "decision"])
