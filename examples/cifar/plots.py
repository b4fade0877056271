"""PNG plots of a training run from its JSONL log (framework-free; matplotlib).

The log holds one JSON object per line with a "type": "layers" (names: the controller's layer
order), "step" (step, epoch, loss, batch_size, mem_used bytes), "epoch" (epoch, train_loss, test_acc
(None: not evaluated that epoch), seconds, flop_share: the run's conv/linear FLOPs per precision so
far, fractions), and "decision" (a controller telemetry record: step, precisions, lr_scales,
lambda_max, batch_size, mem_used, mem_limit, b_noise: the gradient noise scale in samples, None
while unknown, b_noise_warm: whether its EMA was filled, the batch law's condition to act on it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

PRECISION_CODE = {"fp16": 0, "bf16": 1, "fp32": 2}


def read_log(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Records of the log grouped by type."""
    out: dict[str, list[dict[str, Any]]] = {"step": [], "epoch": [], "decision": [], "run": []}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.setdefault(r["type"], []).append(r)
    return out


def noise_series(decisions: list[dict[str, Any]]) -> tuple[list[int], list[float], list[bool]]:
    """(steps, B_noise in samples, warm) at the decisions that had a finite, positive estimate (the
    unbiased estimator can come out negative on a noisy reading; the controller then holds); warm:
    the estimate's EMA was filled, so the batch law acted on it (logs without the flag: True)."""
    pts = [(d["step"], float(d["b_noise"]), bool(d.get("b_noise_warm", True))) for d in decisions
           if d.get("b_noise") is not None and np.isfinite(d["b_noise"]) and d["b_noise"] > 0]
    return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]


def plot_run(log_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the run's PNGs into out_dir; returns their paths (plots without data are skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    log = read_log(log_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    layers = log["layers"][0]["names"] if log.get("layers") else []

    def save(fig, name: str) -> None:
        p = out / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    decisions = log["decision"]
    if decisions:
        steps = [d["step"] for d in decisions]
        grid = np.array([[PRECISION_CODE[p] for p in d["precisions"]] for d in decisions]).T
        fig, ax = plt.subplots(figsize=(10, max(3.0, 0.12 * grid.shape[0] + 1.5)))
        cmap = ListedColormap(["#4c9be8", "#f2b134", "#d1495b"])
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=2.5,
                  extent=(-0.5, len(steps) - 0.5, grid.shape[0] - 0.5, -0.5))
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).astype(int)
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        if layers and len(layers) <= 80:
            ax.set_yticks(range(len(layers)), layers, fontsize=5)
        ax.set_xlabel("step (control decisions)")
        ax.set_ylabel("layer")
        ax.set_title("per-layer precision (blue FP16, amber BF16, red FP32)")
        save(fig, "precision_heatmap.png")

        lam = np.array([[np.nan if x is None else x for x in d["lambda_max"]] for d in decisions], dtype=float)
        if np.isfinite(lam).any():
            fig, ax = plt.subplots(figsize=(10, 4))
            for i in range(lam.shape[1]):
                ax.plot(steps, lam[:, i], lw=0.8, alpha=0.7)
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_xlabel("step")
            ax.set_ylabel("λ_max")
            ax.set_title("top curvature eigenvalue per layer")
            save(fig, "lambda_max.png")

    if log["step"]:
        st = log["step"]
        x = [r["step"] for r in st]
        fig, ax1 = plt.subplots(figsize=(10, 4))
        ax1.plot(x, [r["batch_size"] for r in st], color="#2a6f97", label="batch size")
        ns, nb, warm = noise_series(decisions)
        if ns:   # batch_law="noise" grows the batch while the grown batch is <= c x B_noise (once warm)
            # the bound the run recorded; older logs: their --set value, else that time's default 1.0
            run = log["run"][0] if log["run"] else {}
            c = float(run.get("noise_scale_c", (run.get("options", {}).get("extra") or {}).get("noise_scale_c", 1.0)))
            name = "B_noise (gradient noise scale)" if c == 1.0 else f"{c:g} x B_noise"
            for on, style in ((True, dict(marker="o", mfc="#6a994e")), (False, dict(marker="o", mfc="none"))):
                pts = [(s, c * b) for s, b, w in zip(ns, nb, warm) if w == on]
                if pts:
                    ax1.plot(*zip(*pts), ls="none", ms=3, color="#6a994e", **style,
                             label=name if on else f"{name}, EMA not yet warm")
            ax1.set_yscale("log", base=2)
        ax1.set_xlabel("step")
        ax1.set_ylabel("batch size (samples)")
        mem = [r.get("mem_used") for r in st]
        if any(m is not None for m in mem):
            ax2 = ax1.twinx()
            # memory is read every few steps (None between reads): plot the reads only
            ax2.plot([s for s, m in zip(x, mem) if m is not None], [m / 2**30 for m in mem if m is not None],
                     color="#d1495b", lw=0.8, label="peak memory")
            lim = [d.get("mem_limit") for d in decisions if d.get("mem_limit")]
            if lim:
                ax2.axhline(lim[-1] / 2**30, color="#d1495b", ls="--", lw=0.8, label="MemMax")
            ax2.set_ylabel("GiB")
            ax2.legend(loc="lower right")
        ax1.legend(loc="upper left")
        ax1.set_title("batch size, gradient noise scale and device memory" if ns else "batch size and device memory")
        save(fig, "batch_memory.png")

    shares = [r for r in log["epoch"] if r.get("flop_share")]
    if shares:
        ep = [r["epoch"] for r in shares]
        names = ["fp16", "bf16", "fp32"]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.stackplot(ep, *[[100 * r["flop_share"].get(n, 0.0) for r in shares] for n in names],
                     labels=[n.upper() for n in names], colors=["#4c9be8", "#f2b134", "#d1495b"], step="post")
        ax.axhline(90, color="k", ls="--", lw=0.8, label="90% in 16-bit")
        ax.set_ylim(0, 100)
        ax.set_xlabel("epoch")
        ax.set_ylabel("conv/linear FLOPs so far (%)")
        ax.legend(loc="lower left", fontsize=8)
        ax.set_title("share of the compute per precision")
        save(fig, "flop_share.png")

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        axes[0].plot(x, [r["loss"] for r in st], lw=0.6)
        axes[0].set_xlabel("step")
        axes[0].set_ylabel("train loss")
        axes[0].set_yscale("log")
        ep = [r for r in log["epoch"] if r.get("test_acc") is not None]
        if ep:
            axes[1].plot([r["epoch"] for r in ep], [100 * r["test_acc"] for r in ep], marker="o")
        axes[1].set_xlabel("epoch")
        axes[1].set_ylabel("test accuracy (%)")
        fig.suptitle("loss and accuracy")
        save(fig, "loss_accuracy.png")

    blocks = log.get("block", [])
    if blocks:  # --method local: per-block batch and memory (modelled and measured peak)
        idx = np.arange(len(blocks))
        fig, ax1 = plt.subplots(figsize=(8, 4))
        ax1.bar(idx - 0.2, [b["batch"] for b in blocks], 0.4, color="#2a6f97", label="batch")
        ax1.set_ylabel("batch size (samples)")
        ax1.set_xticks(idx, [f"{b['names'][0]}..{b['names'][-1]}" for b in blocks], fontsize=7)
        ax2 = ax1.twinx()
        ax2.bar(idx + 0.2, [b["peak_bytes"] / 2**20 for b in blocks], 0.4, color="#f2b134", label="modelled peak")
        measured = [b.get("measured_peak_bytes") for b in blocks]
        if any(m is not None for m in measured):
            ax2.plot(idx + 0.2, [np.nan if m is None else m / 2**20 for m in measured], "o", color="#d1495b",
                     label="measured peak")
        if log.get("local_plan"):
            ax2.axhline(log["local_plan"][0]["memory_budget"] / 2**20, color="#d1495b", ls="--", lw=0.8,
                        label="budget")
        ax2.set_ylabel("MiB")
        ax1.legend(loc="upper left")
        ax2.legend(loc="upper right")
        ax1.set_title("local learning: per-block batch and memory")
        save(fig, "local_blocks.png")
    exits = log.get("exits", [])
    if exits:
        e = exits[-1]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(np.array(e["params"]) / 1e6, [100 * a for a in e["accs"]], marker="o")
        ax.plot([e["params"][e["chosen"]] / 1e6], [100 * e["accs"][e["chosen"]]], "*", ms=14, color="#d1495b",
                label=f"chosen exit (tolerance {100 * e['tolerance']:.1f} pt)")
        ax.set_xlabel("exported parameters (M)")
        ax.set_ylabel("test accuracy (%)")
        ax.legend()
        ax.set_title("accuracy per exit")
        save(fig, "local_exits.png")
    return written
