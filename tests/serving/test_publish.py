"""Publishing while training: a Trainer's model published as a full version and then deltas, served by a real
``recstack serve ROOT --watch ROOT`` process that swaps to each delta, refuses a damaged one and one on the wrong
base, and recovers with a later full version; the cadence and full-artifact rules of ``Publisher``."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from recstack.serving.artifact import MANIFEST, ArtifactError, sha256_file
from recstack.serving.model import ServingModel
from recstack.serving.publish import Publisher, PublishSpec
from recstack.serving.watch import load_newest
from recstack.training.hooks import PartitionInfo
from recstack.training.logger import read_jsonl
from recstack.training.trainer import Trainer
from tests.conftest import small_config, write_tiny_dataset
from tests.serving.server_helpers import running

ROWS = 64  # scored rows: the first 64 of the data
QUIET = ["train.eval_every=0", "train.checkpoint_every=0", "train.max_steps=1000", 'optim.sparse="sgd"',
         "optim.sparse_lr=0.05"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("publish") / "data", rows=4000)


def trained(data: Path, run: Path, steps: int = 20) -> Trainer:
    trainer = Trainer(small_config(data, QUIET), run)
    train(trainer, steps)
    return trainer


def train(trainer: Trainer, steps: int, first: int = 0) -> None:
    """``steps`` optimizer steps on consecutive batches of 64 rows from row ``first * 64``."""
    trainer.model.train()
    for i in range(first, first + steps):
        trainer.train_step(trainer.train_ds.batch(64 * i, 64 * (i + 1)))
        trainer.progress.step += 1


def rows_and_offline(trainer: Trainer) -> tuple[list[dict], np.ndarray]:
    """The first ROWS rows as encoded request rows, and the trainer's own probabilities for them."""
    b = trainer.train_ds.batch(0, ROWS)
    f = b.sparse.num_features
    ids = b.sparse.ids.view(f, ROWS)
    rows = [{**{f"I{j + 1}": float(b.dense[i, j]) for j in range(b.dense.shape[1])},
             **{f"C{k + 1}": int(ids[k, i]) for k in range(f)}} for i in range(ROWS)]
    was = trainer.model.training
    trainer.model.eval()
    with torch.no_grad():
        prob = torch.sigmoid(trainer.model(b).float()).numpy()
    trainer.model.train(was)
    return rows, prob


def info(trainer: Trainer, index: int, arrived_at: float) -> PartitionInfo:
    return PartitionInfo(f"part-{index:05d}.tsv", index, arrived_at, 64, trainer.step)


def copy_version(stage: Path, root: Path, version: int, damage: bool = False) -> None:
    """Move a published version into the served root as a publisher would: complete, then renamed into place
    (``damage``: one byte of a delta's rows flipped on the way)."""
    tmp = root / f".{version}.copy"
    shutil.copytree(stage / str(version), tmp)
    if damage:
        f = next(iter(sorted((tmp / "delta").glob("*.npy"))))
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x40
        f.write_bytes(bytes(raw))
    tmp.rename(root / str(version))


def wait_version(server, version: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.client.get("/readyz").json().get("model_version") == version:
            return
        time.sleep(0.1)
    raise AssertionError(f"not serving version {version} after {timeout}s:\n{server.output()}")


def scores(server, rows: list[dict]) -> tuple[int, np.ndarray]:
    r = server.score({"rows": rows, "encoded": True})
    assert r.status_code == 200, r.text
    return r.json()["model_version"], np.asarray(r.json()["scores"])


def test_server_follows_deltas_refuses_damage_and_wrong_base_recovers_on_full(data: Path, tmp_path: Path) -> None:
    trainer = trained(data, tmp_path / "run")
    stage, root = tmp_path / "stage", tmp_path / "models"
    root.mkdir()
    # chain_bytes_ratio: the tiny model's deltas are mostly its dense program, as large as a full artifact's
    pub = Publisher(stage, every_s=0.0, spec=PublishSpec(full_every=3, chain_bytes_ratio=10.0))
    arrived = time.time() - 5.0
    pub.after_partition(trainer, info(trainer, 0, arrived))
    copy_version(stage, root, 1)
    with running([str(root), "--watch", str(root), "--watch-interval", "0.1"], tmp_path / "log") as s:
        rows, want = rows_and_offline(trainer)
        assert scores(s, rows)[0] == 1
        np.testing.assert_allclose(scores(s, rows)[1], want, rtol=0, atol=1e-6)
        assert s.metric("recstack_model_data_arrival_timestamp_seconds") == pytest.approx(arrived, abs=1e-3)

        train(trainer, 3, first=20)  # a few batches: few rows change
        arrived2 = time.time()
        pub.after_partition(trainer, info(trainer, 1, arrived2))
        m2 = json.loads((stage / "2" / MANIFEST).read_text())
        assert m2["delta"]["base"]["version"] == 1 and 0 < m2["delta"]["changed_rows"] < m2["delta"]["total_rows"]
        assert not (stage / "2" / "tables").exists()  # only the changed rows
        copy_version(stage, root, 2)
        wait_version(s, 2)
        rows, want = rows_and_offline(trainer)
        version, got = scores(s, rows)
        assert version == 2
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        assert s.metric("recstack_model_data_arrival_timestamp_seconds") == pytest.approx(arrived2, abs=1e-3)
        assert 0 <= s.metric("recstack_model_freshness_seconds") < 60

        served = got
        train(trainer, 3, first=23)
        pub.after_partition(trainer, info(trainer, 2, time.time()))  # 3: damaged on its way
        copy_version(stage, root, 3, damage=True)
        train(trainer, 3, first=26)
        pub.after_partition(trainer, info(trainer, 3, time.time()))  # 4: a delta on 3, never served
        assert json.loads((stage / "4" / MANIFEST).read_text())["delta"]["base"]["version"] == 3
        copy_version(stage, root, 4)
        deadline = time.monotonic() + 30
        while s.metric("recstack_model_refused_total") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # more polls: each refusal stays one
        assert s.metric("recstack_model_refused_total") == 2
        version, got = scores(s, rows)
        assert version == 2
        np.testing.assert_array_equal(got, served)  # the old version, untouched by the refused deltas
        log = s.output()
        assert log.count("refused model") == 2 and "checksum mismatch" in log and "base in use is version 2" in log

        train(trainer, 3, first=29)
        pub.after_partition(trainer, info(trainer, 4, time.time()))  # 5: full again (full_every=3)
        assert "delta" not in json.loads((stage / "5" / MANIFEST).read_text())
        copy_version(stage, root, 5)
        wait_version(s, 5)
        rows, want = rows_and_offline(trainer)
        np.testing.assert_allclose(scores(s, rows)[1], want, rtol=0, atol=1e-6)
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "publish"]
    assert [r["full"] for r in records] == [1, 0, 0, 0, 1]
    assert all(r["publish_seconds"] > 0 and r["publish_bytes"] > 0 for r in records)
    assert all(0 < r["delta_fraction"] < 0.5 for r in records[1:4])


def test_a_served_root_whose_newest_version_is_a_delta_starts_on_its_chain(data: Path, tmp_path: Path) -> None:
    """``recstack serve ROOT`` at start-up applies the deltas after the full version; a delta refuses a base of
    the same number from another run (its manifest checksum) and rows that do not give the result's checksums."""
    trainer = trained(data, tmp_path / "run")
    root = tmp_path / "models"
    pub = Publisher(root, every_s=0.0, spec=PublishSpec(tables="int8"))
    pub.publish(trainer)
    train(trainer, 2, first=20)
    pub.publish(trainer)
    train(trainer, 2, first=22)
    last = pub.publish(trainer)
    def table_bytes(version: int, prefix: str) -> int:
        files = json.loads((root / str(version) / MANIFEST).read_text())["files"]
        return sum(e["bytes"] for rel, e in files.items() if rel.startswith(prefix))

    assert not last.full and 0 < table_bytes(3, "delta/") < table_bytes(1, "tables/") / 2
    assert last.bytes < json.loads((root / "1" / MANIFEST).read_text())["files"]["dense.pt2"]["bytes"] * 2
    rows, _ = rows_and_offline(trainer)
    direct = ServingModel.load(root / "3", base=ServingModel.load(root / "2", base=ServingModel.load(root / "1")))
    newest = load_newest(root, "cpu")
    assert newest.version == 3
    assert torch.equal(newest.score(newest.encode(rows, ids=True)), direct.score(direct.encode(rows, ids=True)))
    with running([str(root), "--watch", str(root)], tmp_path / "log") as s:
        assert scores(s, rows)[0] == 3

    # rows changed after publishing, their file checksums made to match: the result's table checksum refuses them
    forged = tmp_path / "forged"
    shutil.copytree(root / "2", forged)
    manifest = json.loads((forged / MANIFEST).read_text())
    rel = manifest["delta"]["groups"]["int8"]["data"]
    codes = np.load(forged / rel)
    codes[0, 0] ^= 1
    np.save(forged / rel, codes)
    manifest["files"][rel] = {"sha256": sha256_file(forged / rel), "bytes": (forged / rel).stat().st_size}
    (forged / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="does not match its checksum"):
        ServingModel.load(forged, base=ServingModel.load(root / "1"))

    other = Publisher(tmp_path / "other", every_s=0.0, spec=PublishSpec(tables="int8"))
    other.publish(trainer)  # another version 1
    with pytest.raises(ArtifactError, match="manifest checksum differs"):
        ServingModel.load(root / "2", base=ServingModel.load(tmp_path / "other" / "1"))
    with pytest.raises(ArtifactError, match="base in use is no model"):
        ServingModel.load(root / "2")


def test_cadence_and_full_artifact_rule(data: Path, tmp_path: Path) -> None:
    trainer = trained(data, tmp_path / "run", steps=5)
    now = [1000.0]
    pub = Publisher(tmp_path / "models", every_s=30.0, spec=PublishSpec(max_delta_fraction=0.0),
                    clock=lambda: now[0])
    pub.after_partition(trainer, info(trainer, 0, 990.0))  # the first partition publishes at once
    train(trainer, 1, first=5)
    now[0] += 10
    pub.after_partition(trainer, info(trainer, 1, 1005.0))  # 10 s < 30 s: nothing
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["1"]
    now[0] += 25
    pub.after_partition(trainer, info(trainer, 2, 1020.0))  # 35 s: version 2, full (any changed row > 0.0)
    m = json.loads((tmp_path / "models" / "2" / MANIFEST).read_text())
    assert "delta" not in m and m["freshness"] == {"arrived_at": 1020.0, "partition": "part-00002.tsv"}
    pub.close(trainer)  # nothing trained since: no new version
    train(trainer, 1, first=6)
    pub.close(trainer)  # the final state
    assert sorted(int(p.name) for p in (tmp_path / "models").iterdir()) == [1, 2, 3]
    with pytest.raises(ValueError, match="every_s"):
        Publisher(tmp_path / "x", every_s=-1.0)
