"""benchmarks/step_bound.py on the CPU (--smoke): cases parsed, rows written, bad cases refused."""

from __future__ import annotations

import json

import pytest
import step_bound


def test_smoke_rows(tmp_path):
    out = tmp_path / "sb.json"
    res = step_bound.main(["--smoke", "--steps", "1", "--case", "blk:1:3:4:8", "--case", "e2e:0:9:2:clf",
                           "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["blk", "e2e"] == [r["case"] for r in res["rows"]]
    assert rows[0]["head"] == 8 and rows[1]["head"] == "clf" and rows[0]["input_shape"][0] > 3
    assert all(r["wall_ms"] > 0 and r["issue_ms"] > 0 for r in rows)


@pytest.mark.parametrize("case", ["x:0:99:4", "x:2:1:4", "x:0:4:4", "x:0:4", "x:0:4:4:wide"])
def test_bad_case_named(case, capsys):
    with pytest.raises(SystemExit):
        step_bound.main(["--smoke", "--steps", "1", "--case", case])
    assert "--case" in capsys.readouterr().err
