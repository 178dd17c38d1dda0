"""The directory stream: files in name order, each once; hidden and temporary names ignored until renamed; a
bounded wait for new files; resumable after a position; a missing directory an error. And where ids become
table rows (``cap_ids``), the raw ids kept on the batch."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from recstack.data.batch import Batch, SparseFeatures
from recstack.data.loader import cap_ids
from recstack.data.stream import DirectoryStream, StreamPosition
from recstack.data.stream.partition import partition_reader
from recstack.data.stream.source import is_final_name
from recstack.errors import StreamError


def test_name_order_each_once_hidden_and_temporary_ignored(tmp_path: Path) -> None:
    for name in ("b", "a", ".c.tmp", "_SUCCESS", "d.tmp", "e.partial"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub").mkdir()
    parts = list(DirectoryStream(tmp_path, idle_s=0, poll_s=0.01).partitions())
    assert [(p.name, p.index) for p in parts] == [("a", 0), ("b", 1)]
    assert all(abs(p.arrived_at - time.time()) < 60 for p in parts)
    assert not is_final_name(".part-3") and is_final_name("part-3.tsv")


def test_resume_after_position(tmp_path: Path) -> None:
    for name in ("p0", "p1", "p2"):
        (tmp_path / name).write_text("x")
    parts = list(DirectoryStream(tmp_path, idle_s=0).partitions(StreamPosition("p0", 0)))
    assert [(p.name, p.index) for p in parts] == [("p1", 1), ("p2", 2)]


def test_waits_for_renamed_files_then_stops(tmp_path: Path) -> None:
    """A producer writes a hidden temporary and renames it while the stream waits; after ``idle_s`` without a new
    file the stream ends."""
    (tmp_path / "p0").write_text("x")

    def produce() -> None:
        time.sleep(0.3)
        (tmp_path / ".p1.tmp").write_text("half")
        time.sleep(0.3)
        (tmp_path / ".p1.tmp").rename(tmp_path / "p1")

    producer = threading.Thread(target=produce)
    producer.start()
    t0 = time.monotonic()
    names = [p.name for p in DirectoryStream(tmp_path, idle_s=1.5, poll_s=0.02).partitions()]
    producer.join()
    assert names == ["p0", "p1"]
    assert 2.0 < time.monotonic() - t0 < 10  # waited for p1 (0.6 s), then idle_s after it


def test_late_file_skipped_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p2").write_text("x")
    stream = DirectoryStream(tmp_path, idle_s=0.5, poll_s=0.02)
    names = []
    for p in stream.partitions():
        names.append(p.name)
        (tmp_path / "p1").write_text("late")
    assert names == ["p2"]
    assert "p1 arrived after p2 was consumed" in capsys.readouterr().err


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StreamError, match="no-such: no such directory"):
        list(DirectoryStream(tmp_path / "no-such", idle_s=0).partitions())
    (tmp_path / "f").write_text("x")
    with pytest.raises(StreamError, match="not a directory"):
        DirectoryStream(tmp_path / "f", idle_s=0).check()


def test_cap_ids_a_zero_cap_leaves_ids_raw() -> None:
    raw = torch.tensor([[7, 123456789012], [10, 5]], dtype=torch.int64)  # [B=2, F=2]
    batch = Batch(torch.zeros(2, 1), SparseFeatures.from_dense_ids(raw), torch.zeros(2))
    cap_ids(batch, torch.tensor([4, 0]))
    assert batch.sparse.ids.tolist() == [3, 2, 123456789012, 5]  # feature 0 modulo 4; feature 1 raw


def test_criteo_partition_rows(shared_data: Path, tmp_path: Path) -> None:
    """A raw Criteo partition: raw int64 hashes, transformed dense, labels; a malformed line names file and
    line."""
    reader = partition_reader(None, 0)
    rows = reader.read(shared_data / "criteo_kaggle_raw1000.tsv")
    assert len(rows) == 1000 and rows.ids.dtype == np.int64 and rows.ids.shape == (1000, 26)
    assert rows.dense.shape == (1000, 13) and rows.dense.dtype == np.float32
    assert rows.ids.max() > 20000  # raw hashes: not yet taken modulo the tables
    assert reader.layout.table_sizes == [20000] * 26
    lines = (shared_data / "criteo_kaggle_sample.tsv").read_text().splitlines()[:5]
    lines[3] = lines[3].replace("\t", "\tx", 1)
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:4: field I1"):
        reader.read(bad)
