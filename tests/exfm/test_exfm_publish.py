"""``[experiment.publish_vm]``: one VM's serving head published while it trains (a version at each window end of
its arm, through the serving ``Publisher``: a full artifact, then deltas), served by a real ``recstack serve
--watch`` process that scores like the VM's serving head offline, dynamic id maps included; the report gives the
published VM's NE gain over the VM alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from recstack.cli.main import main
from recstack.data.batch import Batch, SparseFeatures
from recstack.data.prepared_dataset import PreparedDataset
from recstack.exfm.report import ne_gain
from recstack.exfm.vm_stream import load_serving_head
from recstack.serving.artifact import read_manifest
from tests.serving.server_helpers import running

CONFIG = """
[data]
source = "synth"
[data.synth]
rows = 4000
num_days = 6
num_verticals = 2
table_sizes = [300, 200]
num_dense = 2
calibration_rows = 512
drift = 0.1
raw_ids = true
id_churn = 0.2
[stream]
window = 1
vm_start = 3
[fm]
batch_size = 128
[fm.model]
embedding_dim = 4
bottom_mlp = [8, 4]
top_mlp = [8, 1]
max_table_size = 128         # the FM hashes the raw ids
[vm]
batch_size = 64
[vm.model]
embedding_dim = 4
bottom_mlp = [8, 4]
top_mlp = [8, 1]
[vm.model.dynamic_ids]
enabled = true
capacity = 400
[experiment]
arms = ["alone", "aux"]
staleness = [1]
seeds = [0]
verticals = [0]
workers = 2
[experiment.publish_vm]
vertical = 0
arm = "aux"
staleness = 1
"""


def test_a_published_vm_is_served_as_it_scores_offline(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text(CONFIG)
    out = tmp_path / "run"
    assert main(["exfm", "run", "--config", str(tmp_path / "c.toml"), "--output-dir", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    pub = res["published_vm"]
    assert (pub["seed"], pub["vertical"], pub["arm"], pub["staleness"]) == (0, 0, "aux", 1)
    versions = pub["versions"]
    assert [v["version"] for v in versions] == [1, 2, 3]  # windows 3, 4 and 5 of the arm
    assert versions[0]["full"] and not all(v["full"] for v in versions)  # a full artifact, then deltas
    ne = {r["arm"]: r["summary"]["serving"]["ne"] for r in res["vm"]}
    assert pub["ne_gain"] == ne_gain(ne["alone"], ne["aux"])
    assert "Published VM (seed 0, vertical 0, Auxiliary Head, staleness 1)" in (out / "report.md").read_text()
    root = Path(pub["root"])
    assert set(read_manifest(root / "1")["dynamic_ids"]) == {"C1", "C2"}

    (arm_dir,) = (out / "seed0" / "vm" / "v0").glob("aux_d1-*")
    head = load_serving_head(arm_dir)
    assert head.dynamic_ids is not None
    ds = PreparedDataset(json.loads((arm_dir / "job.json").read_text())["data"])
    rows = np.flatnonzero(np.asarray(ds.column("vertical")) == 0)[-60:]  # the last window's rows of vertical 0
    raw = np.array(ds.arrays["sparse"][rows], np.int64)  # [60, 2] raw ids
    raw[::3, 1] = np.arange(0, 60, 3) + 5  # ids no row holds: the default row
    assert bool((head.dynamic_ids.maps["C1"].lookup(torch.from_numpy(raw[:, 0])) > 0).any())  # rows of their own
    dense = np.array(ds.arrays["dense"][rows], np.float32)
    batch = Batch(torch.from_numpy(dense), SparseFeatures.from_dense_ids(torch.from_numpy(raw)), torch.zeros(60))
    with torch.no_grad():
        offline = torch.sigmoid(head(head.dynamic_ids.lookup_batch(batch))).double().numpy()
    body = {"rows": [{"I1": float(d[0]), "I2": float(d[1]), "C1": int(r[0]), "C2": int(r[1])}
                     for d, r in zip(dense, raw, strict=True)], "encoded": True}
    with running([str(root), "--watch", str(root)], tmp_path / "serve.log") as server:
        r = server.score(body)
        assert r.status_code == 200, r.text
        assert r.json()["model_version"] == 3  # the newest version, a delta on the full one
        assert np.abs(np.array(r.json()["scores"]) - offline).max() <= 1e-5
