"""``recstack exfm run`` end to end on a tiny stream, the report's arithmetic and config errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recstack.cli import main
from recstack.config import ConfigError
from recstack.data.format import PreparedDataset
from recstack.exfm.config import load_exfm_config
from recstack.exfm.report import summarize
from recstack.exfm.store import DasStore

TINY = """
[data]
source = "synth"
[data.synth]
rows = 3000
num_days = 5
num_verticals = 3
table_sizes = [40, 30, 50]
num_dense = 2
calibration_rows = 512
drift = 0.1
[stream]
window = 1
vm_start = 3
[fm]
batch_size = 128
[fm.model]
embedding_dim = 4
bottom_mlp = [8, 4]
top_mlp = [8, 1]
[vm]
batch_size = 64
[vm.model]
embedding_dim = 4
bottom_mlp = [8, 4]
top_mlp = [8, 1]
[experiment]
staleness = [1]
seeds = [0]
verticals = [0, 2]
workers = 2
"""


def test_exfm_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "exfm_tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "run"
    assert main(["exfm", "run", "--config", str(cfg), "--output-dir", str(out)]) == 0
    assert "Auxiliary Head + Student Adapter" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    for name in ("ne_gain.png", "ne_by_window.png", "report.md"):
        assert (out / name).stat().st_size > 1000 if name.endswith(".png") else (out / name).is_file()
    runs = {(r["vertical"], r["arm"], r["staleness"]) for r in res["vm"]}
    arms = ("distill", "distill_sa", "aux", "aux_sa")
    want = {(v, "alone", -1) for v in (0, 2)} | {(v, a, 1) for v in (0, 2) for a in arms}
    assert runs == want
    for r in res["vm"]:
        assert [rec["window"] for rec in r["records"]] == [0, 1, 2, 3, 4]  # warm-up + arm windows
        if r["arm"] != "alone":
            assert [rec["fm_version"] for rec in r["records"][3:]] == [3 - r["staleness"], 4 - r["staleness"]]
            assert all(rec["fm_missing"] == 0 for rec in r["records"][3:])
    # the reported gains are the arithmetic of the pooled NEs
    alone = {r["vertical"]: r["summary"]["serving"]["ne"] for r in res["vm"] if r["arm"] == "alone"}
    for row in res["summary"]["arms"]:
        nes = [r["summary"]["serving"]["ne"] for r in res["vm"] if (r["arm"], r["staleness"]) ==
               (row["arm"], row["staleness"])]
        gains = [(alone[r["vertical"]] - ne) / alone[r["vertical"]] * 100 for r, ne in
                 zip([r for r in res["vm"] if (r["arm"], r["staleness"]) == (row["arm"], row["staleness"])], nes,
                     strict=True)]
        assert row["gain"]["mean"] == pytest.approx(float(np.mean(gains)), rel=1e-9)
    # the DAS logged every example of the served verticals exactly once
    store = DasStore(out / "seed0" / "das" / "d1")
    assert store.committed_windows() == [3, 4]
    ids = np.concatenate([store.read_window(w).example_id for w in (3, 4)])
    (data,) = (out / "data").glob("synth_seed0_*")
    ds = PreparedDataset(data)
    served = np.isin(np.asarray(ds.column("vertical")), [0, 2]) & (np.asarray(ds.column("timestamp")) >= 3)
    assert sorted(ids.tolist()) == sorted(np.asarray(ds.column("example_id"))[served].tolist())  # no dup, no gap
    # a rerun finds every task done and reports the same numbers
    before = res["summary"]
    assert main(["exfm", "run", "--config", str(cfg), "--output-dir", str(out)]) == 0
    assert "13 tasks (13 already done)" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["summary"] == before


def test_report_gain_and_spread() -> None:
    def run(seed, v, arm, d, ne):
        return {"seed": seed, "vertical": v, "arm": arm, "staleness": d, "records": [],
                "summary": {"serving": {"ne": ne, "auc": 0.7, "calibration": 1.0}}}

    res = {"vm": [run(0, 0, "alone", -1, 0.80), run(0, 0, "aux", 2, 0.78), run(1, 0, "alone", -1, 0.90),
                  run(1, 0, "aux", 2, 0.891)], "fm": {}}
    row = summarize(res)["arms"][0]
    assert row["gain"]["values"] == pytest.approx([2.5, 1.0])
    assert row["gain"]["mean"] == pytest.approx(1.75) and row["gain"]["std"] == pytest.approx(np.std([2.5, 1.0],
                                                                                                     ddof=1))


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="stream.vm_start: 3 windows leave no published FM snapshot"):
        load_exfm_config(None, ["stream.vm_start=3", "experiment.staleness=[0, 4]"])
    with pytest.raises(ConfigError, match="experiment.arms"):
        load_exfm_config(None, ['experiment.arms=["aux"]'])
    with pytest.raises(ConfigError, match="unknown key 'wieght'"):
        load_exfm_config(None, ["distill.wieght=2.0"])
    cfg = load_exfm_config(None, ["data.synth.rows=500", "data.synth.drift=0.2"])
    assert cfg.data.synth == {"rows": 500, "drift": 0.2}  # table keys are set one by one
