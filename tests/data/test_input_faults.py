"""Damaged text inputs end in one error naming the file (and the line where it is known), not a traceback:
truncated gzip files (libFM, CSV; Criteo raw files are tested in test_criteo.py) and text that is not UTF-8. And
a directory of day files gives only its data files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from recstack.cli.main import main

REPO = Path(__file__).resolve().parents[2]
FRAPPE = REPO / "configs" / "schemas" / "frappe_libfm.toml"
CRITEO_CSV = REPO / "configs" / "schemas" / "criteo_csv.toml"


def libfm_text(rows: int) -> bytes:
    rng = np.random.default_rng(0)
    return "".join(f"{rng.choice([-1, 1])} " + " ".join(f"{10 * i + rng.integers(0, 10)}:1" for i in range(10))
                   + "\n" for _ in range(rows)).encode()


def csv_text(rows: int) -> bytes:
    rng = np.random.default_rng(0)
    header = ",".join(["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))])
    lines = [",".join([str(int(rng.integers(0, 2))), *(f"{v:.3f}" for v in rng.random(13)),
                       *(f"{int(v):08x}" for v in rng.integers(0, 99, 26))]) for _ in range(rows)]
    return ("\n".join([header, *lines]) + "\n").encode()


def truncated_gzip(path: Path, data: bytes) -> Path:
    packed = gzip.compress(data)
    path.write_bytes(packed[: len(packed) * 3 // 4])
    return path


def prepare(schema: Path, raw: Path, out: Path, capsys: pytest.CaptureFixture) -> str:
    """``recstack data prepare --schema`` that must fail with exit 2 -> its one-line error."""
    assert main(["data", "prepare", "--schema", str(schema), str(raw), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
    return err[0]


@pytest.mark.parametrize("rows", [2000, 60000])  # fails in the first read, or after whole blocks of lines
def test_a_truncated_gzip_libfm_file_names_the_file(rows: int, tmp_path: Path, capsys: pytest.CaptureFixture
                                                    ) -> None:
    raw = truncated_gzip(tmp_path / "train.libfm.gz", libfm_text(rows))
    line = prepare(FRAPPE, raw, tmp_path / "out", capsys)
    assert f"{raw}: corrupt or truncated gzip data" in line, line


def test_a_truncated_gzip_csv_file_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = truncated_gzip(tmp_path / "train.csv.gz", csv_text(20000))
    line = prepare(CRITEO_CSV, raw, tmp_path / "out", capsys)
    assert f"{raw}: cannot read it after" in line and "corrupt or truncated" in line, line


def test_invalid_utf8_names_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = csv_text(50).split(b"\n")
    lines[7] = lines[7].replace(b",", b",\xff\xfe", 1)  # a dense value of data row 7 (line 8)
    raw = tmp_path / "train.csv"
    raw.write_bytes(b"\n".join(lines))
    line = prepare(CRITEO_CSV, raw, tmp_path / "out", capsys)
    assert f"{raw}:8: not UTF-8 text" in line, line
    assert main(["data", "inspect", str(raw)]) == 2
    assert f"{raw}:8: not UTF-8 text" in capsys.readouterr().err


def criteo_tsv(rows: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return "".join("\t".join([str(int(rng.random() < 0.3)), *(str(int(v)) for v in rng.integers(0, 50, 13)),
                              *(f"{int(v):08x}" for v in rng.integers(0, 20, 26))]) + "\n" for _ in range(rows))


@pytest.mark.parametrize("schema", [None, CRITEO_CSV])
def test_a_directory_of_day_files_gives_only_its_data_files(schema: Path | None, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    """README, hidden, marker and temporary files beside the day files are not read (each would be a bad row
    or a whole bad file)."""
    days = tmp_path / "days"
    days.mkdir()
    ext = ".csv" if schema else ".tsv"
    for i, rows in enumerate([30, 20]):
        text = csv_text(rows).decode() if schema else criteo_tsv(rows, i)
        (days / f"day_{i}{ext}").write_text(text)
        (days / f".day_{i}{ext}.swp").write_text(text)
    (days / f"day_2{ext}.tmp").write_text("half a file\t1")
    (days / "README.md").write_text("# Day files\nCriteo, one per day.\n")
    (days / "_SUCCESS").write_text("")
    out = tmp_path / "out"
    args = ["data", "prepare", str(days), "--out", str(out)]
    args += ["--schema", str(schema), "--no-progress"] if schema else ["--max-ind-range", "100"]
    assert main(args) == 0, capsys.readouterr().err
    meta = (out / "meta.json").read_text()
    assert '"num_rows": 50' in meta
