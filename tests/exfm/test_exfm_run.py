"""``recstack exfm run`` end to end on a tiny stream, the report's arithmetic and config errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recstack.cli.main import main
from recstack.data.prepared_dataset import PreparedDataset
from recstack.errors import ConfigError
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
    (store_dir,) = (out / "seed0" / "das").glob("d1-*")
    store = DasStore(store_dir)
    assert store.committed_windows() == [3, 4]
    ids = np.concatenate([store.read_window(w).example_id for w in (3, 4)])
    (data,) = (out / "data").glob("synth_seed0_*")
    ds = PreparedDataset(data)
    served = np.isin(np.asarray(ds.column("vertical")), [0, 2]) & (np.asarray(ds.column("timestamp")) >= 3)
    assert sorted(ids.tolist()) == sorted(np.asarray(ds.column("example_id"))[served].tolist())  # no dup, no gap
    # a rerun finds every task done and reports the same numbers
    before = res["summary"]
    assert main(["exfm", "run", "--config", str(cfg), "--output-dir", str(out)]) == 0
    assert "13 tasks (13 reused from an earlier run of the same config, 0 to run)" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["summary"] == before


def test_exfm_rerun_reuses_only_results_of_the_same_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "exfm_tiny.toml"
    cfg.write_text(TINY.replace("rows = 3000", "rows = 2000"))
    out = tmp_path / "run"
    vm_dir = out / "seed0" / "vm" / "v0"
    base = ["exfm", "run", "--config", str(cfg), "--output-dir", str(out), "--set", 'experiment.arms=["alone", "aux"]',
            "--set", "experiment.verticals=[0]", "--set", "experiment.workers=1"]

    def run(*sets: str) -> tuple[str, dict]:
        assert main(base + [x for s in sets for x in ("--set", s)]) == 0
        return capsys.readouterr().out, json.loads((out / "results.json").read_text())

    def jobs() -> list[dict]:
        return [json.loads(p.read_text()) for p in vm_dir.glob("*/result.json")]

    def aux(res: dict) -> dict:
        return next(r for r in res["vm"] if r["arm"] == "aux")

    text, first = run()
    assert "4 tasks (0 reused from an earlier run of the same config, 4 to run)" in text
    # the distillation weight: only the arm with FM labels runs again, and what is reported is made under it
    text, res = run("distill.weight=3.0")
    assert "4 tasks (3 reused from an earlier run of the same config, 1 to run)" in text
    assert res["tasks_run"] == 1 and res["tasks_reused"] == 3
    (new,) = [r for r in jobs() if r["job"]["arm"] == "aux" and r["job"]["distill"]["weight"] == 3.0]
    assert aux(res)["summary"] == new["summary"] != aux(first)["summary"]
    # the VM's learning rate: the warm-up and both arms run again; the FM and its DAS store are reused
    text, _ = run("vm.optim.dense_lr=0.05")
    assert "4 tasks (1 reused from an earlier run of the same config, 3 to run)" in text
    assert len(list((out / "seed0" / "das").glob("d1-*"))) == 1
    # new data: nothing is reused; every task, the FM snapshots and the DAS store are made from the new data
    old_data = set((out / "data").glob("synth_seed0_*"))
    text, res = run("data.synth.drift=0.3")
    assert "4 tasks (0 reused from an earlier run of the same config, 4 to run)" in text
    (new_data,) = set((out / "data").glob("synth_seed0_*")) - old_data
    made = [r["job"] for r in jobs() if r["job"]["data"] == str(new_data)]
    assert sorted((j["phase"], j["arm"]) for j in made) == [("arm", "alone"), ("arm", "aux"), ("warmup", "alone")]
    assert len(list((out / "seed0").glob("fm-*"))) == 2 and len(list((out / "seed0" / "das").glob("d1-*"))) == 2
    (store,) = [j["store"] for j in made if j["arm"] == "aux"]
    ids = np.concatenate([DasStore(store).read_window(w).example_id for w in (3, 4)])
    ds = PreparedDataset(new_data)
    served = (np.asarray(ds.column("vertical")) == 0) & (np.asarray(ds.column("timestamp")) >= 3)
    assert sorted(ids.tolist()) == sorted(np.asarray(ds.column("example_id"))[served].tolist())
    # the first config again: its results are all still there and reused, with the same numbers
    text, res = run()
    assert "4 tasks (4 reused from an earlier run of the same config, 0 to run)" in text
    assert res["summary"] == first["summary"]


def test_exfm_run_refuses_data_without_windows_after_vm_start(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "exfm_tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "run"
    assert main(["exfm", "run", "--config", str(cfg), "--output-dir", str(out), "--set", "data.synth.num_days=3"]) == 2
    err = capsys.readouterr().err
    assert "stream.vm_start" in err and "has 3 windows" in err
    assert not (out / "seed0").exists()  # no task ran
    assert main(["exfm", "run", "--config", str(cfg), "--output-dir", str(out), "--set", "stream.max_windows=3"]) == 2
    assert "stream.max_windows: 3 windows leave none from stream.vm_start=3 on" in capsys.readouterr().err


def test_exfm_run_names_bad_synth_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "exfm_tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "run"
    assert main(["exfm", "run", "--config", str(cfg), "--output-dir", str(out), "--set", "data.synth.rowz=3"]) == 2
    assert "data.synth: unknown key 'rowz'" in capsys.readouterr().err
    assert not out.exists()


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
    with pytest.raises(ConfigError, match=r"stream\.max_windows: 6 windows leave none from stream\.vm_start=6"):
        load_exfm_config(None, ["stream.max_windows=6"])
    assert load_exfm_config(None, ["stream.max_windows=7"]).stream.max_windows == 7
    with pytest.raises(ConfigError, match=r"data\.synth: unknown key 'rowz'"):
        load_exfm_config(None, ["data.synth.rowz=3"])
    with pytest.raises(ConfigError, match=r"data\.synth\.rows: expected int, got str 'abc'"):
        load_exfm_config(None, ["data.synth.rows=abc"])
    with pytest.raises(ConfigError, match=r"data\.synth\.rows: must be >= 1"):
        load_exfm_config(None, ["data.synth.rows=0"])
    with pytest.raises(ConfigError, match=r"data\.synth\.table_sizes"):
        load_exfm_config(None, ['data.synth.table_sizes=["a"]'])
    with pytest.raises(ConfigError, match=r"data\.movielens: unknown key 'pth'"):
        load_exfm_config(None, ['data.source="movielens"', 'data.movielens.path="ml"', 'data.movielens.pth="x"'])
    cfg = load_exfm_config(None, ["data.synth.rows=500", "data.synth.drift=0.2"])
    assert cfg.data.synth == {"rows": 500, "drift": 0.2}  # table keys are set one by one
