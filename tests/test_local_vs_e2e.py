"""benchmarks/local_vs_e2e.py: same-seed ratios, mean rows, the runs it launches (demo runs faked)."""

from __future__ import annotations

import pytest
import local_vs_e2e as lv


def _e2e(seed, acc, secs):
    return {"variant": "e2e", "seed": seed, "final_acc": acc, "epoch_seconds": secs, "device_name": "GPU X",
            "wall_s": sum(secs) + 5.0}


def _local(variant, seed, accs, train_s, chosen=0):
    return {"variant": variant, "seed": seed, "exit_accs": accs, "chosen_acc": accs[chosen], "train_seconds": train_s,
            "param_reduction": 16.0, "model_params": 1000, "exit_params": [100, 500, 1000][:len(accs)],
            "peak_alloc_bytes": 2**20, "memory_budget_bytes": 2 * 2**20}


def test_rows_ratios_within_a_seed_and_means():
    runs = [_e2e(0, 0.87, [10.0, 10.0]), _local("local", 0, [0.85, 0.86, 0.84], 10.0),
            _e2e(1, 0.88, [20.0, 20.0]), _local("local", 1, [0.80, 0.87], 30.0),
            {"variant": "local-fresh", "seed": 1, "failed": True}]
    rows = lv.rows_of(runs)
    by = {(r["variant"], r["seed"]): r for r in rows}
    r0 = by[("local", 0)]
    assert r0["best_acc"] == 0.86 and r0["points_vs_e2e"] == pytest.approx(-1.0)
    assert r0["ratio_vs_e2e"] == pytest.approx(0.5) and r0["best_exit_param_reduction"] == 2.0
    assert r0["wall_s"] is None and r0["wall_ratio_vs_e2e"] is None   # a summary without its process wall
    timed = lv.rows_of([_e2e(0, 0.87, [10.0, 10.0]), {**_local("local", 0, [0.85], 10.0), "wall_s": 12.5}])
    assert timed[1]["wall_ratio_vs_e2e"] == pytest.approx(12.5 / 25.0) and timed[0]["wall_ratio_vs_e2e"] == 1.0
    assert by[("local", 1)]["ratio_vs_e2e"] == pytest.approx(0.75)
    assert by[("e2e", 0)]["ratio_vs_e2e"] == 1.0 and by[("e2e", 0)]["train_s"] == 20.0
    mean = by[("local", "mean")]
    assert mean["seeds"] == 2 and mean["ratio_vs_e2e"] == pytest.approx(0.625)
    assert mean["points_vs_e2e"] == pytest.approx(-1.0)
    assert by[("local-fresh", 1)]["failed"] and ("local-fresh", "mean") not in by
    assert r0["ratio_vs_e2e_graph"] is None
    lv.print_table(rows)
    # with the CUDA-graphed end-to-end run beside: a second ratio, against it
    graph = {**_e2e(0, 0.87, [4.0, 4.0]), "variant": "e2e-graph"}
    by = {(r["variant"], r["seed"]): r for r in lv.rows_of(runs + [graph])}
    assert by[("local", 0)]["ratio_vs_e2e_graph"] == pytest.approx(10.0 / 8.0)
    assert by[("e2e-graph", 0)]["ratio_vs_e2e"] == pytest.approx(0.4) and by[("local", 1)]["ratio_vs_e2e_graph"] is None


def test_e2e_batch_from_the_budget():
    assert lv.e2e_batch("e2e:32", None) == 32 and lv.e2e_batch("512MiB", 16) == 16
    for budget, given in (("e2e:0", None), ("e2e:32", 64), ("512MiB", None)):
        with pytest.raises(ValueError):
            lv.e2e_batch(budget, given)


def test_main_runs_every_variant_per_seed(monkeypatch, tmp_path):
    calls = []

    def fake(args, out, workdir=None, gpu=None, timeout=None):
        assert timeout == 50.0
        calls.append(list(args))
        if "local" in args:
            return _local("x", 0, [0.8, 0.82], 5.0)
        return {"final_acc": 0.85, "epoch_seconds": [10.0], "device_name": "GPU X"}

    monkeypatch.setattr(lv, "run_demo", fake)
    res = lv.main(["--data", "d", "--seeds", "0", "1", "--out", str(tmp_path / "r.json"), "--run-timeout", "50",
                   "--local-args", "--graph-reserve 64MiB", "--", "--lr", "0.2"])
    assert all(("--graph-reserve" in c) == ("local" in c) for c in calls)   # local variants only
    assert len(calls) == 6 and all(c[c.index("--lr") + 1] == "0.2" for c in calls)   # extra options reach every run
    assert [c[c.index("--seed") + 1] for c in calls] == ["0", "0", "0", "1", "1", "1"]
    assert calls[0][-4:] == ["--method", "amp", "--batch", "32"]
    assert calls[1][-6:] == ["--method", "local", "--budget", "e2e:32", "--graph-reserve", "64MiB"]
    assert calls[2][-8:] == ["--method", "local", "--block-inputs", "fresh", "--budget", "e2e:32", "--graph-reserve",
                             "64MiB"]
    mean = {r["variant"]: r for r in res["rows"] if r["seed"] == "mean"}
    assert mean["local"]["ratio_vs_e2e"] == pytest.approx(0.5) and (tmp_path / "r.json").exists()
    with pytest.raises(SystemExit):
        lv.main(["--data", "d", "--budget", "1GiB"])
    lv.main(["--data", "d", "--seeds", "0", "--variants", "e2e-graph", "--out", str(tmp_path / "g.json"),
             "--run-timeout", "50"])
    assert calls[-1][-6:] == ["--method", "amp", "--batch", "32", "--compile", "reduce-overhead"]
    # --e2e-args: the end-to-end variants' own options (e.g. their best learning rate)
    calls.clear()
    lv.main(["--data", "d", "--seeds", "0", "--variants", "e2e", "local-fresh", "--e2e-args", "--lr 0.0083",
             "--out", str(tmp_path / "a.json"), "--run-timeout", "50"])
    assert calls[0][-2:] == ["--lr", "0.0083"] and "--lr" not in calls[1]
    # the local runs' own epochs: e2e keeps --epochs; the row says which each run had
    calls.clear()
    res = lv.main(["--data", "d", "--seeds", "0", "--variants", "e2e", "local-fresh", "--epochs", "10",
                   "--local-epochs", "20", "--out", str(tmp_path / "e.json"), "--run-timeout", "50"])
    assert [c[c.index("--epochs") + 1] for c in calls] == ["10", "20"]
    for bad in (["--local-epochs", "0"], ["--epochs", "0"]):
        with pytest.raises(SystemExit):
            lv.main(["--data", "d", *bad])


def test_epochs_of_a_run():
    assert lv.epochs_of({"options": {"epochs": 20}, "local_options": {"block_epochs": None}}) == "20"
    assert lv.epochs_of({"options": {"epochs": 10}, "local_options": {"block_epochs": [10, 15, 15]}}) == "10,15,15"
    assert lv.epochs_of({"final_acc": 0.8}) is None
    rows = lv.rows_of([{**_e2e(0, 0.87, [10.0]), "options": {"epochs": 10}},
                       {**_local("local-fresh", 0, [0.85, 0.86], 5.0), "options": {"epochs": 20}}])
    by = {(r["variant"], r["seed"]): r for r in rows}
    assert by[("e2e", 0)]["epochs"] == "10" and by[("local-fresh", "mean")]["epochs"] == "20"
    lv.print_table(rows)


def test_a_killed_run_reports_how_far_it_got(monkeypatch, tmp_path, capsys):
    import json

    def fake(args, out, workdir=None, gpu=None, timeout=None):
        if "local" in args:
            return _local("x", 0, [0.8, 0.82], 5.0)
        # end-to-end killed at its timeout in epoch 3: two epoch records and a line cut off by the kill
        out.mkdir(parents=True, exist_ok=True)
        recs = [{"type": "run"}, {"type": "epoch", "epoch": 1, "test_acc": 0.38, "seconds": 69.5},
                {"type": "epoch", "epoch": 2, "test_acc": 0.47, "seconds": 75.0}]
        (out / "log.jsonl").write_text("\n".join(map(json.dumps, recs)) + '\n{"type": "ep')
        return None

    monkeypatch.setattr(lv, "run_demo", fake)
    res = lv.main(["--data", "d", "--seeds", "2", "--variants", "local-fresh", "e2e", "--runs", str(tmp_path / "runs"),
                   "--out", str(tmp_path / "k.json"), "--run-timeout", "50"])
    by = {(r["variant"], r["seed"]): r for r in res["rows"]}
    assert by[("e2e", 2)]["failed"]
    assert by[("e2e", 2)]["progress"] == {"epochs_done": 2, "last_test_acc": 0.47, "epoch_seconds": 144.5}
    # no finished end-to-end run: no ratio and no points for local
    assert by[("local-fresh", 2)]["points_vs_e2e"] is None and by[("local-fresh", 2)]["ratio_vs_e2e"] is None
    assert "e2e              2  failed after 2 epoch(s) (144.5 s; last test acc 47.00%): no ratio" in capsys.readouterr().out
    assert lv.progress_of(tmp_path / "missing.jsonl") is None
    (tmp_path / "empty.jsonl").write_text('{"type": "run"}\n')
    assert lv.progress_of(tmp_path / "empty.jsonl") is None
