"""``recstack exfm run --stream DIR``: the FM, the DAS and the VMs read a directory stream while a producer writes
it, and give the records of a run on the same rows as a prepared set (windows = partitions in both)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from recstack.cli.main import main
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.synth.generate import SynthConfig, generate
from recstack.errors import StreamError
from recstack.exfm.config import StreamSourceSpec
from recstack.exfm.stream_windows import MANIFEST, DirectoryWindows
from recstack.exfm.windows import Window

SCHEMA = """
[source]
format = "csv"
[label]
column = "label"
[[dense]]
name = "I1"
[[dense]]
name = "I2"
[[sparse]]
name = "C1"
encoding = "identity"
size = 30
[[sparse]]
name = "C2"
encoding = "identity"
size = 40
[[sparse]]
name = "C3"
encoding = "hash"
hash_size = 64
[columns]
example_id = "example_id"
timestamp = "day"
vertical = "vertical"
"""

CONFIG = """
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
arms = ["alone", "aux"]
staleness = [1]
seeds = [0]
verticals = [0, 1]
workers = 2
"""

HEADER = "label,I1,I2,C1,C2,C3,vertical,example_id,day"


def _partitions(tmp: Path) -> list[tuple[str, str]]:
    """A 5-day synthetic log as CSV partitions, one a day: [(file name, text)]. Vertical names are letters,
    so their ids come from the order they appear in."""
    data = generate(SynthConfig(rows=1500, num_days=5, num_verticals=3, table_sizes=(30, 40, 50), num_dense=2,
                                calibration_rows=256, seed=3), tmp / "synth", progress=False)
    ds = PreparedDataset(data)
    a = {k: np.asarray(ds.column(k)) for k in ("labels", "dense", "sparse", "vertical", "example_id", "timestamp")}
    out = []
    for day in range(5):
        rows = np.flatnonzero(a["timestamp"] == day)
        lines = [HEADER] + [
            f"{int(a['labels'][r])},{float(a['dense'][r, 0])!r},{float(a['dense'][r, 1])!r},"
            f"{a['sparse'][r, 0]},{a['sparse'][r, 1]},x{a['sparse'][r, 2]},{'cab'[a['vertical'][r]]},"
            f"{a['example_id'][r]},{day}" for r in rows]
        out.append((f"part-{day:03d}.csv", "\n".join(lines) + "\n"))
    return out


def _write(directory: Path, name: str, text: str) -> None:
    """As producers do: a hidden temporary, renamed into place."""
    tmp = directory / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, directory / name)


def _comparable(res: dict) -> dict:
    """The FM's and the VMs' records and summaries, without wall times."""
    def records(rs: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "train_seconds"} for r in rs]

    fm = res["fm"]["0"]
    vms = sorted(res["vm"], key=lambda r: (r["vertical"], r["arm"], r["staleness"]))
    return {"fm": [records(fm["records"]), fm["summary"]],
            "vm": [[r["vertical"], r["arm"], r["staleness"], records(r["records"]), r["summary"]] for r in vms]}


def test_exfm_run_follows_a_directory_stream_as_its_prepared_set(tmp_path: Path) -> None:
    parts = _partitions(tmp_path)
    schema, cfg = tmp_path / "schema.toml", tmp_path / "exfm.toml"
    schema.write_text(SCHEMA)
    cfg.write_text(CONFIG)
    # the same rows as a prepared set, made from the same files with the same schema
    files = tmp_path / "files"
    files.mkdir()
    for name, text in parts:
        (files / name).write_text(text)
    prepared = tmp_path / "prepared"
    assert main(["data", "prepare", "--schema", str(schema), *[str(files / n) for n, _ in parts],
                 "--out", str(prepared)]) == 0
    assert main(["exfm", "run", "--config", str(cfg), "--output-dir", str(tmp_path / "a"),
                 "--set", 'data.source="prepared"', "--set", f'data.prepared="{prepared}"']) == 0
    expected = _comparable(json.loads((tmp_path / "a" / "results.json").read_text()))

    stream = tmp_path / "stream"
    stream.mkdir()
    _write(stream, *parts[0])
    taken: list[float] = []

    def produce() -> None:  # the rest arrives once the FM has taken the first window, while the experiment runs
        deadline = time.time() + 120
        while not list((tmp_path / "b").glob(f"seed0/fm-*/{MANIFEST}")) and time.time() < deadline:
            time.sleep(0.05)
        taken.append(time.time())
        for name, text in parts[1:]:
            time.sleep(0.5)
            _write(stream, name, text)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        assert main(["exfm", "run", "--config", str(cfg), "--output-dir", str(tmp_path / "b"), "--stream",
                     str(stream), "--schema", str(schema), "--stream-idle-s", "4"]) == 0
    finally:
        producer.join()
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    got = _comparable(res)
    assert [r["window"] for r in got["fm"][0]] == [0, 1, 2, 3, 4]
    assert len(got["vm"]) == 4 and all(len(v[3]) == 5 for v in got["vm"])
    assert got == expected  # bit for bit: the same windows, vertical ids, example ids and batches
    (manifest,) = (tmp_path / "b" / "seed0").glob(f"fm-*/{MANIFEST}")
    m = json.loads(manifest.read_text())
    assert m["ended"] and [e["name"] for e in m["entries"]] == [n for n, _ in parts]
    assert all(e["arrived_at"] > taken[0] for e in m["entries"][1:])  # written while the FM was following
    assert res["vertical_names"] == m["entries"][-1]["verticals"] and sorted(res["vertical_names"]) == list("abc")


def test_a_bad_partition_is_one_error_naming_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    schema, cfg, stream = tmp_path / "schema.toml", tmp_path / "exfm.toml", tmp_path / "stream"
    schema.write_text(SCHEMA)
    cfg.write_text(CONFIG)
    stream.mkdir()
    _write(stream, "part-000.csv", f"{HEADER}\n1,0.5,1.0,3,4,x1,a,10,0\n0,0.5,oops,3,4,x1,b,11,0\n")
    code = main(["exfm", "run", "--config", str(cfg), "--output-dir", str(tmp_path / "run"), "--stream",
                 str(stream), "--schema", str(schema), "--stream-idle-s", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{stream / 'part-000.csv'}:3" in lines[0] and "I2" in lines[0], lines[0]


def test_stream_config_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "exfm.toml"
    cfg.write_text(CONFIG)
    base = ["exfm", "run", "--config", str(cfg), "--output-dir", str(tmp_path / "run")]
    for extra, want in ((["--stream", str(tmp_path)], "data.stream.schema"),
                        (["--set", 'data.source="prepared"'], "data.prepared: the prepared data set's directory"),
                        (["--set", 'data.source="kafka"'], "data.source: 'kafka' is not one of synth, movielens"),
                        (["--schema", "s.toml"], "--schema and --stream-idle-s: only with --stream"),
                        (["--set", 'data.source="stream"', "--set", "data.stream.bogus=1"], "data.stream.bogus"),
                        (["--stream", str(tmp_path / "none"), "--schema", "s.toml", "--set",
                          "experiment.verticals=[]"], "experiment.verticals"),
                        (["--stream", str(tmp_path / "none"), "--schema", str(cfg)], "no such directory")):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err, (extra, err)


def _spec(tmp_path: Path, idle_s: float) -> StreamSourceSpec:
    (tmp_path / "schema.toml").write_text(SCHEMA)
    (tmp_path / "in").mkdir(exist_ok=True)
    return StreamSourceSpec(dir=str(tmp_path / "in"), schema=str(tmp_path / "schema.toml"), idle_s=idle_s)


def _csv(verticals: str, first_id: int) -> str:
    return HEADER + "\n" + "".join(f"{i % 2},0.5,{i},{i % 30},{i % 40},x{i},{v},{first_id + i},0\n"
                                   for i, v in enumerate(verticals))


def test_followers_see_the_windows_the_leader_took(tmp_path: Path) -> None:
    spec = _spec(tmp_path, idle_s=0.3)
    stream, manifest = Path(spec.dir), tmp_path / MANIFEST
    _write(stream, "p0.csv", _csv("aab", 100))
    _write(stream, "p1.csv", _csv("cbb", 200))  # vertical c first appears here, before b in this file; no a
    leader = DirectoryWindows(spec, manifest, leader=True, wait_s=0.0, poll_s=0.05)
    w0, w1 = leader.window(0), leader.window(1)
    assert (w0, w1) == (Window(0, 0, 3), Window(1, 3, 6))
    want_rows = {v: leader.rows(w1, v).tolist() for v in range(3)}
    assert want_rows == {0: [], 1: [4, 5], 2: [3]}  # a=0, b=1 (window 0), c=2
    assert leader.example_ids(np.array([3, 5])).tolist() == [200, 202] and leader.verticals() == [0, 1, 2]
    assert leader.window(2) is None  # the idle wait ran out: the leader ends the stream
    _write(stream, "p2.csv", _csv("a", 300))  # too late: not a window of this stream
    follower = DirectoryWindows(spec, manifest, leader=False, wait_s=5.0, poll_s=0.05)
    assert follower.window(1) == w1  # starts at window 1, numbers its rows and verticals as the leader did
    assert {v: follower.rows(w1, v).tolist() for v in range(3)} == want_rows
    assert follower.example_ids(np.array([3, 5])).tolist() == [200, 202] and follower.verticals() == [0, 1, 2]
    batch = follower.data.gather(follower.rows(w1, 2), ("vertical", "example_id"))
    assert batch.extras["example_id"].tolist() == [200] and batch.sparse.ids.numel() == 3
    assert follower.window(2) is None


def test_a_follower_waits_a_bounded_time_for_the_leader(tmp_path: Path) -> None:
    spec = _spec(tmp_path, idle_s=60.0)
    _write(Path(spec.dir), "p0.csv", _csv("a", 0))
    follower = DirectoryWindows(spec, tmp_path / MANIFEST, leader=False, wait_s=0.3, poll_s=0.05)
    with pytest.raises(StreamError, match="window 0 of stream .* not taken by the foundation model after 0 s"):
        follower.window(0)


def test_a_stream_describes_itself_to_the_publisher(tmp_path: Path) -> None:
    """What a VM published from a stream is exported with (``WindowSource.describe``): the stream's directory and
    its schema's encoders, whose ids a dynamic table's map takes in training and in serving alike."""
    from recstack.serving.transforms import transforms_from_data

    spec = _spec(tmp_path, idle_s=0.3)
    _write(Path(spec.dir), "p0.csv", _csv("ab", 0))
    windows = DirectoryWindows(spec, tmp_path / MANIFEST, leader=True, wait_s=0.0, poll_s=0.05)
    layout = windows.features
    raw = [True] + [False] * (len(layout.table_names) - 1)
    desc = windows.describe(raw)
    assert desc.path == Path(spec.dir) and desc.table_names == layout.table_names
    assert desc.dense_features == layout.dense_features
    assert desc.table_sizes == layout.table_sizes
    doc, _ = transforms_from_data(desc)
    assert doc["kind"] == "schema"
