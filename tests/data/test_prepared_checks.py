"""A prepared directory whose values training cannot use is refused before any step, naming the file and the row:
labels other than 0/1, NaN/Inf inputs, a ``num_rows`` that disagrees with the arrays, a changed dtype of the same
size, bad multi-hot offsets, meta.json without a required key, a negative table size. The user path is a real
``recstack train`` process: exit 2 and a one-line error, no traceback."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import RECSTACK, SMALL, run_cli, train_args, train_steps, write_tiny_dataset

from recstack.data.format import PreparedFormatError, SparseFeatureSpec
from recstack.data.integrity import check_values, fingerprint
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.prepared_writer import PreparedWriter

ROWS = 600


def _write(path: Path, multi_hot: bool = False, weighted: bool = False) -> Path:
    rng = np.random.default_rng(0)
    dense = rng.random((ROWS, 3)).astype(np.float32)
    labels = (rng.random(ROWS) < 0.3).astype(np.float32)
    specs = [SparseFeatureSpec("C1", 20), SparseFeatureSpec("C2", 7)]
    jagged = None
    if multi_hot:
        specs.append(SparseFeatureSpec("bag", 30, multi_hot=True, weighted=weighted))
        lengths = rng.integers(0, 4, ROWS)
        ids = rng.integers(0, 30, int(lengths.sum()))
        jagged = {"bag": (lengths, ids, rng.random(len(ids)).astype(np.float32) if weighted else None)}
    with PreparedWriter(path, ["I1", "I2", "I3"], specs) as w:
        w.write(labels, dense, np.stack([rng.integers(0, 20, ROWS), rng.integers(0, 7, ROWS)], 1), jagged)
    return path


def _poke(path: Path, array: str, index: tuple[int, ...], value: float) -> None:
    """Set one entry of an array file in place (as a damaged or hand-edited file would hold it)."""
    spec = json.loads((path / "meta.json").read_text())["arrays"][array]
    m = np.memmap(path / spec["file"], dtype=spec["dtype"], mode="r+", shape=tuple(spec["shape"]))
    m[index] = value
    m.flush()


def _edit_meta(path: Path, edit) -> None:
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def _refused(path: Path, pattern: str) -> None:
    with pytest.raises(PreparedFormatError, match=pattern):
        check_values(PreparedDataset(path))


@pytest.mark.parametrize("value", [5.0, -1.0, 0.5, float("nan")])
def test_a_label_other_than_0_or_1_names_file_and_row(tmp_path: Path, value: float) -> None:
    data = _write(tmp_path / "d")
    _poke(data, "labels", (417,), value)
    _refused(data, rf"^{re.escape(str(data / 'labels.bin'))}: row 417: label {re.escape(repr(value))}, "
                   r"expected 0 or 1$")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_dense_input_names_file_row_and_feature(tmp_path: Path, value: float) -> None:
    data = _write(tmp_path / "d")
    _poke(data, "dense", (123, 2), value)
    _refused(data, rf"{re.escape(str(data / 'dense.bin'))}: row 123: dense feature 'I3': {re.escape(repr(value))}")


def test_the_scan_reads_in_small_chunks_and_finds_the_first_bad_row(tmp_path: Path) -> None:
    data = _write(tmp_path / "d")
    _poke(data, "dense", (599, 0), float("nan"))
    _poke(data, "dense", (301, 1), float("inf"))
    ds = PreparedDataset(data)
    for chunk in (12, 100, 4096, 1 << 24):  # rows per chunk from 1 to all
        with pytest.raises(PreparedFormatError, match=r"row 301: dense feature 'I2': inf"):
            check_values(ds, chunk_bytes=chunk)
    check_values(ds, rows=(0, 301), chunk_bytes=100)  # rows before it are fine
    with pytest.raises(PreparedFormatError, match="row 599"):
        check_values(ds, rows=(302, 600), chunk_bytes=100)


def test_num_rows_that_disagrees_with_the_arrays(tmp_path: Path) -> None:
    data = _write(tmp_path / "d")
    _edit_meta(data, lambda m: m.update(num_rows=ROWS + 50))  # the arrays' shapes (and files) keep 600 rows
    with pytest.raises(PreparedFormatError, match=rf"labels.bin: shape \[{ROWS}\], but num_rows {ROWS + 50}"):
        PreparedDataset(data)
    _edit_meta(data, lambda m: m.update(num_rows=ROWS - 1))
    with pytest.raises(PreparedFormatError, match=rf"labels.bin: shape \[{ROWS}\], but num_rows {ROWS - 1}"):
        PreparedDataset(data)


def test_meta_json_without_a_required_key_names_file_and_key(tmp_path: Path) -> None:
    data = _write(tmp_path / "d")
    for key in ("arrays", "num_rows", "dense_features", "sparse_features"):
        _write(tmp_path / key)
        _edit_meta(tmp_path / key, lambda m, key=key: m.pop(key))
        with pytest.raises(PreparedFormatError, match=rf"{re.escape(str(tmp_path / key / 'meta.json'))}: key "
                                                      rf"'{key}' is missing"):
            PreparedDataset(tmp_path / key)
    _edit_meta(data, lambda m: m["arrays"]["labels"].pop("dtype"))
    with pytest.raises(PreparedFormatError, match=r"meta.json: arrays entry 'labels' is malformed"):
        PreparedDataset(data)


def test_a_negative_table_size_names_the_feature(tmp_path: Path) -> None:
    data = _write(tmp_path / "d")
    _edit_meta(data, lambda m: m["sparse_features"][1].update(num_embeddings=-3))
    with pytest.raises(PreparedFormatError, match=r"meta.json: bad sparse_features entry \(sparse feature 'C2': "
                                                  r"table size -3, must be at least 1\)"):
        PreparedDataset(data)


@pytest.mark.parametrize(("array", "dtype"), [("sparse", "float32"), ("labels", "int32"), ("dense", "uint32")])
def test_a_dtype_of_the_same_size_changed_in_meta_json(tmp_path: Path, array: str, dtype: str) -> None:
    data = _write(tmp_path / "d")
    _edit_meta(data, lambda m: m["arrays"][array].update(dtype=dtype))
    with pytest.raises(PreparedFormatError, match=rf"{re.escape(str(data / (array + '.bin')))}: meta.json gives "
                                                  rf"dtype {dtype} for '{array}'"):
        PreparedDataset(data)


def test_bad_multi_hot_offsets_name_file_and_row(tmp_path: Path) -> None:
    data = _write(tmp_path / "d", multi_hot=True)
    check_values(PreparedDataset(data))  # as written: fine
    off = np.fromfile(data / "bag.offsets.bin", np.int64)
    _poke(data, "bag.offsets", (200,), int(off[201]) + 1)  # bag 199 ends after bag 200 does
    _refused(data, rf"{re.escape(str(data / 'bag.offsets.bin'))}: row 200: offsets of 'bag' decrease")
    _poke(data, "bag.offsets", (200,), int(off[-1]) + 100)  # beyond the values
    _refused(data, r"bag.offsets.bin: row 200: offset \d+ is outside the \d+ values of 'bag'")
    _poke(data, "bag.offsets", (200,), -5)
    _refused(data, r"bag.offsets.bin: row 200: offset -5 is outside")


def test_non_finite_bag_weights_name_the_row(tmp_path: Path) -> None:
    data = _write(tmp_path / "d", multi_hot=True, weighted=True)
    off = np.fromfile(data / "bag.offsets.bin", np.int64)
    row = next(r for r in range(50, ROWS) if off[r + 1] > off[r])  # the first non-empty bag from row 50
    _poke(data, "bag.weights", (int(off[row]),), float("nan"))
    _refused(data, rf"bag.weights.bin: row {row}: weight nan")


def test_the_fingerprint_sees_other_rows_and_options(tmp_path: Path) -> None:
    a, b = _write(tmp_path / "a"), _write(tmp_path / "b")
    assert fingerprint(PreparedDataset(a)) == fingerprint(PreparedDataset(b))  # the same bytes elsewhere
    _poke(b, "labels", (ROWS - 1,), 1.0 - float(np.fromfile(b / "labels.bin", np.float32)[-1]))  # the last row
    assert fingerprint(PreparedDataset(a)) != fingerprint(PreparedDataset(b))


# -- the user path: `recstack train` stops before its first step ------------------------------------------------

@pytest.mark.parametrize("damage", ["label", "nan", "no_arrays"])
def test_recstack_train_refuses_bad_data_with_one_line(tmp_path: Path, damage: str) -> None:
    data = _write(tmp_path / "d")
    want = {
        "label": (lambda: _poke(data, "labels", (42,), 5.0), rf"{re.escape(str(data / 'labels.bin'))}: row 42: "
                                                              r"label 5.0, expected 0 or 1"),
        "nan": (lambda: _poke(data, "dense", (77, 0), float("nan")), r"dense.bin: row 77: dense feature 'I1': nan"),
        "no_arrays": (lambda: _edit_meta(data, lambda m: m.pop("arrays")), r"meta.json: key 'arrays' is missing"),
    }[damage]
    want[0]()
    out = tmp_path / "run"
    res = run_cli(train_args(out, data, [*SMALL, "train.max_steps=3"]))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert re.fullmatch(rf"recstack train: error: .*{want[1]}.*", lines[-1]), res.stderr[-2000:]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()  # no step was trained


def test_recstack_eval_and_predict_refuse_bad_rows_they_would_score(tmp_path: Path) -> None:
    data = _write(tmp_path / "d")
    run = tmp_path / "run"
    train_steps(data, run, ["train.max_steps=2"])
    bad = _write(tmp_path / "bad")
    _poke(bad, "dense", (500, 1), float("inf"))
    for args in (["eval", "--checkpoint", str(run), "--data", str(bad)],
                 ["predict", "--checkpoint", str(run), "--data", str(bad), "--out", str(tmp_path / "s.csv")]):
        res = run_cli(args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert re.search(rf"error: {re.escape(str(bad / 'dense.bin'))}: row 500: dense feature 'I2': inf",
                         res.stderr.splitlines()[-1]), res.stderr[-2000:]
    assert not (tmp_path / "s.csv").exists()


def test_a_file_cut_short_under_training_is_an_error_not_sigbus(tmp_path: Path) -> None:
    """A prepared set's ``dense.bin`` truncated in place to half its size while ``recstack train``
    reads it through memory maps (a later batch's rows would lie past the new end: SIGBUS): the run
    stops with one line naming the file, exit 2. A file replaced by rename is not this case: the
    maps keep the old one."""
    data = write_tiny_dataset(tmp_path / "data")
    run = tmp_path / "run"
    args = train_args(run, data, [*SMALL, "train.epochs=20", "train.checkpoint_every=20",
                                  "train.eval_every=0", "train.log_every=10"])
    proc = subprocess.Popen([*RECSTACK, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    dense = data / "dense.bin"
    try:
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline and not (
                (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())):
            time.sleep(0.01)
        assert proc.poll() is None, "training ended before the file could be cut"
        with open(dense, "r+b") as f:
            f.truncate(dense.stat().st_size // 2)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, (proc.returncode, signal.Signals(-proc.returncode).name
                                  if proc.returncode < 0 else "", err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert re.search(rf"recstack train: error: {re.escape(str(dense))}: \d+ bytes on disk, \d+ "
                     "when it was opened: the file was cut short while in use", err), err[-2000:]
