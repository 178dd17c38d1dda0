"""A raw Criteo stream trained with ``recstack train --stream DIR --publish ROOT`` (dynamic ids on every table, the
default for a raw stream) and served by a real ``recstack serve ROOT --watch ROOT`` process: the server starts on
a full version and a delta (tables and id maps), follows the versions a resumed run publishes, and scores raw
rows as the trainer's own checkpoint does; the freshness gauge is set from the newest partition's arrival."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from recstack.data.loader import cap_ids
from recstack.data.stream.partition import CriteoPartitions
from recstack.training.inference import load_model
from tests.conftest import SMALL, run_cli, set_options
from tests.serving.server_helpers import request_rows, running

ROWS = 300  # per partition


def write_partition(lines: list[str], directory: Path, i: int) -> Path:
    """Partition ``i`` (rows ROWS * i ..), written as a hidden temporary and renamed, as a producer does."""
    tmp, final = directory / f".part-{i:03d}.tmp", directory / f"part-{i:03d}"
    tmp.write_text("".join(lines[i * ROWS : (i + 1) * ROWS]))
    tmp.rename(final)
    return final


def publish_run(stream: Path, run: Path, root: Path, *flags: str) -> None:
    args = ["train", "--output-dir", str(run), "--stream", str(stream), "--stream-idle-s", "0", "--publish",
            str(root), "--publish-every-s", "0", *set_options([*SMALL, "train.log_every=4"]), *flags]
    res = run_cli(args, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def offline(run: Path, part: Path) -> tuple[list[dict], np.ndarray]:
    """The partition's rows as request rows, and the newest checkpoint's probabilities for them (ids looked up
    in its id maps without admitting, as evaluation does)."""
    cfg, model = load_model(run, last=True)
    assert model.dynamic_ids is not None
    rows = CriteoPartitions(20000).read(part)
    batch = rows.batch(0, len(rows))
    cap_ids(batch, torch.zeros(26, dtype=torch.int64))  # every table dynamic: the raw ids reach the maps
    batch = model.dynamic_ids.lookup_batch(batch)
    with torch.no_grad():
        prob = torch.sigmoid(model.eval()(batch).float()).numpy()
    fields = [line.rstrip("\n").split("\t") for line in part.read_text().splitlines(keepends=True)]
    return request_rows(fields), prob


def served(server, rows: list[dict]) -> np.ndarray:  # type: ignore[no-untyped-def]
    r = server.score({"rows": rows})
    assert r.status_code == 200, r.text
    return np.array(r.json()["scores"])


def test_a_stream_published_while_it_trains_is_served(shared_data: Path, tmp_path: Path) -> None:
    lines = (shared_data / "criteo_kaggle_sample.tsv").read_text().splitlines(keepends=True)
    stream, run, root = tmp_path / "in", tmp_path / "run", tmp_path / "models"
    stream.mkdir()
    parts = [write_partition(lines, stream, i) for i in range(2)]
    publish_run(stream, run, root)
    manifests = {v: json.loads((root / str(v) / "manifest.json").read_text()) for v in (1, 2)}
    assert "delta" not in manifests[1] and manifests[2]["delta"]["base"]["version"] == 1
    assert set(manifests[2]["dynamic_ids"]) == {f"C{j}" for j in range(1, 27)}  # the maps' changes travel
    assert manifests[2]["freshness"]["partition"] == "part-001"
    published = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    published = [r for r in published if r["kind"] == "publish"]
    assert [(r["version"], r["full"]) for r in published] == [(1, 1), (2, 0)]
    assert all(r["published_after_arrival_s"] > 0 for r in published)
    with running([str(root), "--watch", str(root), "--watch-interval", "0.5"], tmp_path / "serve.log") as server:
        rows, want = offline(run, parts[1])
        assert np.abs(served(server, rows) - want).max() <= 1e-5  # version 2: version 1 and its delta
        assert server.metric("recstack_model_freshness_seconds") > 0
        parts += [write_partition(lines, stream, i) for i in (2, 3)]
        publish_run(stream, run, root, "--resume")  # a new publisher: a full version 3, then the delta 4
        assert json.loads((root / "4" / "manifest.json").read_text())["delta"]["base"]["version"] == 3
        rows, want = offline(run, parts[3])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and np.abs(served(server, rows) - want).max() > 1e-5:
            time.sleep(0.5)
        assert np.abs(served(server, rows) - want).max() <= 1e-5, server.output()
        assert "version 4" in server.output()
