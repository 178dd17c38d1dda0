"""The DAS and its store: exactly once under SIGKILL, staleness schedule, VMs never train on unlabelled
examples silently."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.synth.generate import SynthConfig, generate
from recstack.exfm.config import NetSpec, StreamConfig
from recstack.exfm.das import DasJob, run_das
from recstack.exfm.fm import build_net, publish_snapshot
from recstack.exfm.store import DasStore, MissingFMLabels
from recstack.exfm.vm_stream import VerticalSource
from recstack.exfm.windows import VerticalIndex, make_windows, staleness_version

FIRST = 2  # the first window the DAS labels


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 6-day, 3-vertical synthetic log and FM snapshots 1..5 (differently seeded, untrained)."""
    root = tmp_path_factory.mktemp("das")
    data = generate(SynthConfig(rows=3000, num_days=6, num_verticals=3, table_sizes=(30, 40, 50), num_dense=2,
                                calibration_rows=512, seed=4), root / "data", progress=False)
    ds = PreparedDataset(data)
    spec = NetSpec()
    spec.model.embedding_dim, spec.model.bottom_mlp, spec.model.top_mlp = 4, [8, 4], [8, 1]
    for version in range(1, 6):
        publish_snapshot(root / "snapshots", version, build_net(spec, ds, version), spec, ds)
    return data, root / "snapshots"


def _job(data: Path, snaps: Path, stores: list[Path], **kw) -> DasJob:
    return DasJob(data=str(data), snapshots=str(snaps), feeds=[[str(s), d] for s, d in zip(stores, (0, 1),
                  strict=True)], stream=StreamConfig(window=1.0), first_window=FIRST, part_rows=40, wait_s=30.0,
                  **kw)


def _das(job: DasJob, path: Path) -> subprocess.Popen:
    job.save(path)
    return subprocess.Popen([sys.executable, "-m", "recstack.exfm.das", "--job", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _expected(data: Path) -> dict[int, np.ndarray]:
    ds = PreparedDataset(data)
    eid = np.asarray(ds.column("example_id"))
    return {w.index: eid[w.start : w.end] for w in make_windows(ds, StreamConfig(window=1.0))[FIRST:]}


def test_staleness_schedule() -> None:
    assert [staleness_version(t, 0, 1) for t in range(4)] == [None, 1, 2, 3]
    assert [staleness_version(t, 2, 1) for t in range(5)] == [None, None, None, 1, 2]
    assert [staleness_version(t, 1, 3) for t in range(9)] == [None] * 4 + [3, 3, 3, 6, 6]


def test_killed_das_restarts_without_duplicates_or_gaps(stream: tuple[Path, Path], tmp_path: Path) -> None:
    data, snaps = stream
    ref = [tmp_path / "ref0", tmp_path / "ref1"]
    run_das(_job(data, snaps, ref), log=lambda line: None)
    stores = [tmp_path / "d0", tmp_path / "d1"]

    # 1. the DAS is killed (SIGKILL, by fault injection) in the middle of the second window it labels
    parts_per_window = 2 * len(list(DasStore(ref[0]).window_dir(FIRST).glob("*.parquet")))  # two feeds
    p = _das(_job(data, snaps, stores, crash_after_parts=parts_per_window + 3), tmp_path / "a.json")
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL
    half = FIRST + 1
    assert DasStore(stores[0]).is_committed(FIRST) and not DasStore(stores[0]).is_committed(half)
    assert list(DasStore(stores[0]).window_dir(half).glob("*.parquet"))  # half written
    # a write torn by the kill leaves a temporary file behind
    (DasStore(stores[1]).window_dir(half) / "v000-00001.parquet.tmp").write_bytes(b"torn")
    # 2. restart: it finishes the stream
    p = _das(_job(data, snaps, stores), tmp_path / "b.json")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert '"das_window": 2' not in out  # the committed window is not redone

    expected = _expected(data)
    for store, reference in zip(stores, ref, strict=True):
        s, r = DasStore(store), DasStore(reference)
        assert s.verify(expected) == {"duplicates": 0, "missing": 0, "unexpected": 0}
        assert not list(store.rglob("*.tmp"))
        for w in expected:
            got, want = s.read_window(w), r.read_window(w)
            np.testing.assert_array_equal(got.example_id, want.example_id)
            np.testing.assert_array_equal(got.fm_logit, want.fm_logit)  # same snapshot, same scores
            assert got.snapshot_version == want.snapshot_version
    d0, d1 = DasStore(stores[0]), DasStore(stores[1])
    assert [d0.read_window(w).snapshot_version for w in expected] == [staleness_version(w, 0, 1) for w in expected]
    assert [d1.read_window(w).snapshot_version for w in expected] == [staleness_version(w, 1, 1) for w in expected]


def test_verify_counts_duplicates_and_gaps(tmp_path: Path) -> None:
    s = DasStore(tmp_path)
    s.begin_window(3, 1, {"a": 2, "b": 2})
    s.write_part(3, "a", np.array([10, 11]), np.zeros(2), 1, np.zeros(2))
    s.write_part(3, "b", np.array([11, 12]), np.zeros(2), 1, np.zeros(2))
    assert s.verify({3: np.array([10, 11, 12, 13])}) == {"duplicates": 1, "missing": 1, "unexpected": 0}
    s.commit_window(3)
    with pytest.raises(RuntimeError, match="example id 11 is logged 2 times"):
        s.read_window(3)


def test_unlabelled_examples_are_waited_for_or_reported(stream: tuple[Path, Path], tmp_path: Path) -> None:
    data, _ = stream
    ds = PreparedDataset(data)
    index = VerticalIndex(ds)
    w = make_windows(ds, StreamConfig(window=1.0))[3]
    rows = index.rows(w, 1)
    eid = np.asarray(ds.column("example_id"))[rows]
    store = DasStore(tmp_path / "s")
    half = len(rows) // 2
    store.begin_window(3, 2, {"v001-00000": half, "v001-00001": len(rows) - half})
    store.write_part(3, "v001-00000", eid[:half], np.arange(half, dtype=np.float32), 2, np.ones(half))

    with pytest.raises(MissingFMLabels, match="has not finished window 3"):
        store.lookup(3, eid, wait_s=0.2)
    source = VerticalSource(ds, index, 1, 64, None, store, 0.1, "drop")
    got_rows, logits, info = source.joined(w)
    assert info == {"fm_version": 2, "fm_missing": len(rows) - half}
    np.testing.assert_array_equal(got_rows, rows[:half])
    np.testing.assert_array_equal(logits, np.arange(half, dtype=np.float32))
    with pytest.raises(MissingFMLabels):
        list(VerticalSource(ds, index, 1, 64, None, store, 0.1, "error").batches(w, 64))

    def finish() -> None:  # the DAS catches up while the VM waits
        time.sleep(0.3)
        store.write_part(3, "v001-00001", eid[half:], np.full(len(rows) - half, 7.0, np.float32), 2,
                         np.ones(len(rows) - half))
        store.commit_window(3)

    t = threading.Thread(target=finish)
    t.start()
    logits, found, version = DasStore(tmp_path / "s").lookup(3, eid, wait_s=30.0)
    t.join()
    assert found.all() and version == 2 and (logits[half:] == 7.0).all()
