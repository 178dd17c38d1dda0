"""Training from a stream of partitions: progressive validation, partition hooks, a checkpoint per partition
with the stream position, SIGKILL and --resume giving the uninterrupted run's model, partitions arriving (hidden
temporary, then renamed) while the run trains, and the errors a user can cause. Real Criteo rows, split into
partitions in the test's directory; real ``recstack train --stream`` processes."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from recstack.data.stream import DirectoryStream, partition_reader
from recstack.training.checkpoint.checkpointer import Checkpointer
from recstack.training.hooks import PartitionInfo
from recstack.training.stream import StreamTrainer
from recstack.training.trainer import Trainer
from tests.conftest import (
    SMALL,
    count_checkpoints,
    kill_after_checkpoints,
    run_cli,
    set_options,
    small_config,
    start_cli,
)

OPTIONS = [*SMALL, "model.max_table_size=1000", "train.log_every=4"]


def write_partitions(shared_data: Path, directory: Path, n: int, rows: int) -> list[Path]:
    """The first ``n * rows`` real Criteo rows as ``n`` partitions part-000.. (written as a hidden temporary and
    renamed, as a producer does)."""
    lines = (shared_data / "criteo_kaggle_sample.tsv").read_text().splitlines(keepends=True)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        tmp, final = directory / f".part-{i:03d}.tmp", directory / f"part-{i:03d}"
        tmp.write_text("".join(lines[i * rows : (i + 1) * rows]))
        tmp.rename(final)
        paths.append(final)
    return paths


def stream_args(out: Path, stream: Path, idle_s: float, *flags: str) -> list[str]:
    return ["train", "--output-dir", str(out), "--stream", str(stream), "--stream-idle-s", str(idle_s),
            *set_options(OPTIONS), *flags]


class Recorder:
    """A partition hook that records what it is told."""

    def __init__(self) -> None:
        self.infos: list[PartitionInfo] = []
        self.checkpoints: list[int | None] = []
        self.closed = 0

    def after_partition(self, trainer: Trainer, info: PartitionInfo) -> None:
        self.infos.append(info)
        self.checkpoints.append(trainer.checkpointer.saved_at)

    def close(self, trainer: Trainer) -> None:
        self.closed += 1


def test_progressive_validation_and_hooks(shared_data: Path, tmp_path: Path) -> None:
    write_partitions(shared_data, tmp_path / "in", 2, 300)
    cfg = small_config(None, ["model.max_table_size=1000", "train.log_every=4"])
    trainer = StreamTrainer(cfg, DirectoryStream(tmp_path / "in", idle_s=0), partition_reader(None, 1000),
                            tmp_path / "run")
    hook = Recorder()
    trainer.add_hook(hook)
    t0 = time.time()
    summary = trainer.train()
    assert [(i.name, i.index, i.rows) for i in hook.infos] == [("part-000", 0, 300), ("part-001", 1, 300)]
    assert [i.step for i in hook.infos] == [5, 10] == hook.checkpoints  # ceil(300 / 64) steps; saved before hooks
    assert all(i.arrived_at <= t0 for i in hook.infos) and hook.closed == 1
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    prog = [r for r in records if r["kind"] == "progressive"]
    assert [(r["step"], r["partition"], r["rows"]) for r in prog] == [(5, 0, 300), (10, 1, 300)]
    assert prog[0]["running_auc"] == prog[0]["progressive_auc"] != prog[1]["running_auc"]
    assert 0 < prog[1]["progressive_logloss"] < 1
    assert summary["partitions"] == 2 and summary["stream_position"] == "part-001"
    assert summary["progressive_examples"] == 600 and summary["progressive_auc"] == prog[1]["running_auc"]
    state = Checkpointer.read(tmp_path / "run", "cpu")
    assert state["step"] == 10 and state["stream"]["position"] == {"name": "part-001", "index": 1}


def final_model(run: Path) -> dict[str, torch.Tensor]:
    return Checkpointer.read(run, "cpu")["model"]


def test_sigkill_and_resume_give_the_uninterrupted_model(shared_data: Path, tmp_path: Path) -> None:
    write_partitions(shared_data, tmp_path / "in", 4, 400)
    whole = run_cli(stream_args(tmp_path / "whole", tmp_path / "in", 0.5), timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    proc = kill_after_checkpoints(stream_args(tmp_path / "cut", tmp_path / "in", 0.5),
                                  tmp_path / "cut" / "checkpoints", 1)
    assert proc.returncode == -signal.SIGKILL  # killed mid-stream, after the first partition's checkpoint
    assert count_checkpoints(tmp_path / "cut" / "checkpoints") < 4
    resumed = run_cli(stream_args(tmp_path / "cut", tmp_path / "in", 0.5, "--resume"), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: continuing from" in resumed.stdout
    a, b = final_model(tmp_path / "whole"), final_model(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (json.loads((tmp_path / r / "summary.json").read_text()) for r in ("whole", "cut"))
    for key in ("steps", "train_samples", "partitions", "stream_position", "progressive_auc", "progressive_logloss"):
        assert sa[key] == sb[key], key
    assert sb["partitions_this_run"] < 4
    prog = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["partition"] for r in prog if r["kind"] == "progressive"] == [0, 1, 2, 3]  # each once


def test_partitions_arriving_while_training(shared_data: Path, tmp_path: Path) -> None:
    """The run starts on an empty directory; a producer writes hidden temporaries and renames them while it
    trains; a temporary never renamed (its content is not even Criteo) is never read."""
    stream = tmp_path / "in"
    stream.mkdir()
    (stream / ".part-009.tmp").write_text("not a partition\n")
    lines = (shared_data / "criteo_kaggle_sample.tsv").read_text().splitlines(keepends=True)
    proc = start_cli(stream_args(tmp_path / "run", stream, 8))
    try:
        for i in range(2):
            tmp = stream / f".part-{i:03d}.tmp"
            with open(tmp, "w") as f:
                f.write("".join(lines[i * 300 : i * 300 + 150]))
                f.flush()
                time.sleep(0.5)  # half-written: the stream must not take it yet
                f.write("".join(lines[i * 300 + 150 : (i + 1) * 300]))
            tmp.rename(stream / f"part-{i:03d}")
            deadline = time.time() + 120
            while count_checkpoints(tmp_path / "run" / "checkpoints") < i + 1 and time.time() < deadline:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                time.sleep(0.05)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["partitions"] == 2 and summary["stream_position"] == "part-001"
    assert summary["progressive_examples"] == 600 and summary["train_samples"] == 600


@pytest.mark.parametrize("case", ["missing_dir", "bad_line"])
def test_stream_errors_name_the_directory_or_line(shared_data: Path, tmp_path: Path, case: str) -> None:
    stream = tmp_path / "in"
    if case == "bad_line":
        lines = (shared_data / "criteo_kaggle_sample.tsv").read_text().splitlines(keepends=True)[:50]
        lines[6] = lines[6].replace("\t", "\t1.5\t", 1)  # one field too many
        stream.mkdir()
        (stream / "part-000").write_text("".join(lines))
    res = run_cli(stream_args(tmp_path / "run", stream, 0), timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if ": error: " in line]
    want = f"--stream {stream}: no such directory" if case == "missing_dir" else f"{stream / 'part-000'}:7: line has 41"
    assert len(errors) == 1 and want in errors[0], res.stderr[-3000:]


SCHEMA = """
[source]
format = "csv"
[label]
column = "label"
[[dense]]
name = "I1"
transform = "log1p"
[[sparse]]
name = "C1"
encoding = "hash"
hash_size = 97
[[sparse]]
name = "C2"
encoding = "{encoding}"
hash_size = 101
"""


def test_schema_stream(shared_data: Path, tmp_path: Path) -> None:
    """CSV partitions read through a schema (hash encodings): the ids are the encoder's rows; a vocab encoding,
    which needs statistics over a fixed set, is an error naming the feature."""
    rows = [line.split("\t") for line in (shared_data / "criteo_kaggle_sample.tsv").read_text().splitlines()]
    stream = tmp_path / "in"
    stream.mkdir()
    for i in range(2):
        body = "".join(f"{r[0]},{r[1]},{r[14]},{r[15]}\n" for r in rows[i * 200 : (i + 1) * 200])
        (stream / f"part-{i}.csv").write_text("label,I1,C1,C2\n" + body)
    schema = tmp_path / "schema.toml"
    schema.write_text(SCHEMA.format(encoding="hash"))
    reader = partition_reader(str(schema), 0)
    assert reader.layout.table_sizes == [97, 101] and reader.layout.reserved_rows == [1, 1]
    trainer = StreamTrainer(small_config(None), DirectoryStream(stream, idle_s=0), reader, tmp_path / "run")
    summary = trainer.train()
    assert summary["partitions"] == 2 and summary["progressive_examples"] == 400
    ids = reader.read(stream / "part-0.csv").ids
    assert ids.shape == (200, 2) and 1 <= ids.min() and ids[:, 0].max() < 97
    schema.write_text(SCHEMA.format(encoding="vocab"))
    with pytest.raises(ValueError, match="sparse feature 'C2': a stream cannot use encoding 'vocab'"):
        partition_reader(str(schema), 0)
