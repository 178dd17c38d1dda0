"""Bad input: every kind of broken row names file, line (or row) and column; --skip-bad-rows skips and
reports them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recstack.cli.main import main
from recstack.data.prepare.readers import DataError
from recstack.data.prepare.schema import schema_from_dict
from recstack.data.prepare.schema_prepare import prepare_dataset
from recstack.data.prepared_dataset import PreparedDataset

BASE = {
    "label": {"column": "rating", "threshold": 4.0, "min": 1.0, "max": 5.0},
    "dense": [{"name": "age"}],
    "sparse": [{"name": "user"}, {"name": "item", "encoding": "identity", "size": 100}],
}
GOOD = ["rating,age,user,item", "5,30,u1,3", "2,41,u2,7", "4,,u1,99"]


def _csv(tmp_path: Path, lines: list[str], name: str = "bad.csv") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def _prepare(tmp_path: Path, path: Path, schema: dict | None = None, **kw) -> object:
    return prepare_dataset(schema_from_dict(schema or BASE), [path], tmp_path / "out", progress=False, **kw)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("3,abc,u3,1", r"bad\.csv:5: column 'age': not a number \(got 'abc'\)"),
        ("3,inf,u3,1", r"bad\.csv:5: column 'age': not a finite number"),
        ("7,20,u3,1", r"bad\.csv:5: column 'rating': label outside its range \[1, 5\] \(got '7'\)"),
        ("x,20,u3,1", r"bad\.csv:5: column 'rating': label is not a number \(got 'x'\)"),
        (",20,u3,1", r"bad\.csv:5: column 'rating': label is missing"),
        ("3,20,u3,1,extra", r"bad\.csv:5: 5 fields, expected 4 \(got '3,20,u3,1,extra'\)"),
        ("3,20,u3", r"bad\.csv:5: 3 fields, expected 4"),
        ("3,20,u3,100", r"bad\.csv:5: column 'item': id is beyond the declared size 100 \(ids must be 0\.\.99\) "
                        r"\(got '100'\)"),
        ("3,20,u3,-1", r"bad\.csv:5: column 'item': id is not a non-negative integer \(got '-1'\)"),
        ("3,20,u3,99999999999999999999", r"bad\.csv:5: column 'item': id is beyond the declared size 100"),
        ("3,20,u3,2.5", r"bad\.csv:5: column 'item': id is not a non-negative integer \(got '2\.5'\)"),
    ],
)
def test_csv_bad_rows_name_file_line_and_column(tmp_path: Path, line: str, match: str) -> None:
    path = _csv(tmp_path, [*GOOD, line, "1,50,u4,4"])
    with pytest.raises(DataError, match=match):
        _prepare(tmp_path, path)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_label_without_threshold_must_be_binary(tmp_path: Path) -> None:
    schema = {**BASE, "label": {"column": "rating"}}
    path = _csv(tmp_path, ["rating,age,user,item", "1,3,a,1", "0,3,b,1", "2,3,c,1"])
    with pytest.raises(DataError, match=r"bad\.csv:4: column 'rating': label must be 0 or 1 .*\(got '2'\)"):
        _prepare(tmp_path, path, schema)


def test_unknown_column_names_file_and_column(tmp_path: Path) -> None:
    schema = {**BASE, "dense": [{"name": "agee"}]}
    with pytest.raises(DataError, match=r"bad\.csv: column 'agee': no such column in the file "
                                        r"\(it has: rating, age, user, item\)"):
        _prepare(tmp_path, _csv(tmp_path, GOOD), schema)


def test_tsv_ragged_row(tmp_path: Path) -> None:
    lines = [x.replace(",", "\t") for x in [*GOOD, "3,20,u3"]]
    with pytest.raises(DataError, match=r"bad\.tsv:5: 3 fields, expected 4"):
        _prepare(tmp_path, _csv(tmp_path, lines, "bad.tsv"))


def test_parquet_wrong_types(tmp_path: Path) -> None:
    good = {"rating": [5, 3, 1], "user": ["a", "b", "c"], "item": [1, 2, 3]}
    pq.write_table(pa.table({**good, "age": pa.array([[1], [2], [3]])}), tmp_path / "list.parquet")
    with pytest.raises(DataError, match=r"list\.parquet: column 'age': has type list<.*>, which cannot hold a "
                                        r"number value"):
        _prepare(tmp_path, tmp_path / "list.parquet")
    pq.write_table(pa.table({**good, "age": ["1", "2.5", "old"]}), tmp_path / "text.parquet")
    with pytest.raises(DataError, match=r"text\.parquet row 3: column 'age': not a number \(got 'old'\)"):
        _prepare(tmp_path, tmp_path / "text.parquet")
    pq.write_table(pa.table({**good, "age": [1.0, 2.0, 3.0], "item": [[1], [2, 3], [4]]}), tmp_path / "m.parquet")
    with pytest.raises(DataError, match=r"m\.parquet row 2: column 'item': has several values but the feature is "
                                        r"not multi_hot"):
        _prepare(tmp_path, tmp_path / "m.parquet")


def test_bad_timestamp(tmp_path: Path) -> None:
    schema = {**BASE, "columns": {"timestamp": "ts"}}
    path = _csv(tmp_path, ["rating,age,user,item,ts", "5,30,u1,3,2024-01-02", "2,41,u2,7,yesterday"])
    with pytest.raises(DataError, match=r"bad\.csv:3: column 'ts': not a timestamp .*\(got 'yesterday'\)"):
        _prepare(tmp_path, path, schema)


FM_SCHEMA = {"label": {"threshold": 0.0},
             "sparse": [{"name": "features", "multi_hot": True, "encoding": "identity", "size": 10}]}


@pytest.mark.parametrize(
    ("line", "schema", "match"),
    [
        ("1 3:1 12:1", FM_SCHEMA, r"f\.libfm:2: column 'features': id is beyond the declared size 10 \(.*\) "
                                  r"\(got '12'\)"),
        ("1 3:abc", FM_SCHEMA, r"f\.libfm:2: token 1: index not a non-negative integer or value not a number "
                               r"\(got '3:abc'\)"),
        ("1 3", FM_SCHEMA, r"f\.libfm:2: token 1 is not idx:val \(got '3'\)"),
        ("1 3:1 99999999999999999999:1", FM_SCHEMA,
         r"f\.libfm:2: token 2: index larger than 9223372036854775807 \(2\*\*63 - 1\) "
         r"\(got '99999999999999999999:1'\)"),
        ("yes 3:1", FM_SCHEMA, r"f\.libfm:2: column 'label': label is not a number \(got 'yes'\)"),
        ("1 3:1 5:1", {**FM_SCHEMA, "source": {"fields": ["a", "b", "c"]},
                       "sparse": [{"name": n} for n in "abc"]},
         r"f\.libfm:2: 2 idx:val pairs, expected 3 \(one per field: a, b, c\)"),
        ("1 3:1 25:1", {**FM_SCHEMA, "source": {"field_ranges": {"a": [0, 10], "b": [10, 20]}},
                        "sparse": [{"name": "a", "multi_hot": True}, {"name": "b", "multi_hot": True}]},
         r"f\.libfm:2: index is in no field of \[source\] field_ranges \(got '25'\)"),
    ],
)
def test_libfm_bad_rows(tmp_path: Path, line: str, schema: dict, match: str) -> None:
    path = tmp_path / "f.libfm"
    path.write_text("1 1:1 2:1 4:1\n" + line + "\n0 5:1 6:1 7:1\n")
    with pytest.raises(DataError, match=match):
        _prepare(tmp_path, path, schema)


def test_skip_bad_rows_keeps_the_good_ones_and_reports(tmp_path: Path) -> None:
    lines = [*GOOD, "3,20,u3", "9,20,u3,1", "1,50,u4,4", "3,abc,u5,1", "2,10,u6,5"]
    path = _csv(tmp_path, lines)
    report = _prepare(tmp_path, path, skip_bad_rows=True)
    assert report.rows == {"all": 5} and report.skipped == 3
    assert [str(b).split(": ")[0] for b in report.bad_rows] == [f"{path}:5", f"{path}:6", f"{path}:8"]
    ds = PreparedDataset(tmp_path / "out")
    assert ds.column("labels").tolist() == [1, 0, 1, 0, 0]  # ratings 5, 2, 4, 1, 2
    assert np.asarray(ds.column("sparse"))[:, 1].tolist() == [4, 8, 100, 5, 6]  # item + 1
    assert ds.info["skipped_rows"] == 3


def test_cli_reports_bad_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    schema = tmp_path / "s.toml"
    schema.write_text('[label]\ncolumn = "rating"\nthreshold = 4.0\nmax = 5.0\n[[dense]]\nname = "age"\n'
                      '[[sparse]]\nname = "user"\n')
    path = _csv(tmp_path, [*GOOD, "9,20,u3,1"])
    args = ["data", "prepare", "--schema", str(schema), str(path), "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{path}:5: column 'rating': label outside its range" in err
    assert main([*args, "--skip-bad-rows"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 bad rows" in out and f"{path}:5: column 'rating'" in out
    assert PreparedDataset(tmp_path / "o").num_rows == 3


def test_weights_that_do_not_match_their_values(tmp_path: Path) -> None:
    schema = {"sparse": [{"name": "tags", "multi_hot": True, "weight_column": "w"}]}
    path = _csv(tmp_path, ["label,tags,w", "1,a|b,0.5|2", "0,a|c,0.5", "1,b,x"])
    with pytest.raises(DataError, match=r"bad\.csv:3: column 'w': has a different number of values than 'tags' "
                                        r"\(got '0\.5'\)"):
        _prepare(tmp_path, path, schema)
    report = _prepare(tmp_path, path, schema, skip_bad_rows=True, overwrite=True)
    assert [str(b) for b in report.bad_rows] == [
        f"{path}:3: column 'w': has a different number of values than 'tags' (got '0.5')",
        f"{path}:4: column 'w': weight is not a finite number (got 'x')",
    ]


def test_libfm_index_beyond_int64_is_a_skippable_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "f.libfm"
    path.write_text("1 3:1 5:1\n\n-1 99999999999999999999:1 2:1\n0 4:1\n")
    schema = {"label": {"threshold": 0.0}, "sparse": [{"name": "features", "multi_hot": True}]}
    report = _prepare(tmp_path, path, schema, skip_bad_rows=True)
    assert report.rows == {"all": 2} and report.skipped == 1
    assert [str(b) for b in report.bad_rows] == [
        f"{path}:3: token 1: index larger than 9223372036854775807 (2**63 - 1) (got '99999999999999999999:1')"]


def test_bad_rows_are_reported_in_line_order(tmp_path: Path) -> None:
    # a bad value (line 2) before a row with the wrong field count (line 3): the first is the error
    path = _csv(tmp_path, ["rating,age,user,item", "3,zz,u1,1", "3,20", "4,20,u2,2"])
    with pytest.raises(DataError, match=r"bad\.csv:2: column 'age': not a number"):
        _prepare(tmp_path, path)
    # libFM: an id beyond the size (found by the encoder, line 2) before a malformed pair (the reader, line 3)
    fm = tmp_path / "f.libfm"
    fm.write_text("1 1:1\n1 3:1 12:1\n0 3:abc\n0 4:1\n")
    with pytest.raises(DataError, match=r"f\.libfm:2: column 'features': id is beyond the declared size"):
        _prepare(tmp_path, fm, FM_SCHEMA)
    # with --skip-bad-rows the listed rows are in line order whatever the chunk size
    lines = ["rating,age,user,item"]
    for i in range(300):
        lines.append("3,20" if i % 37 == 5 else f"3,{'bad' if i % 23 == 7 else i},u{i % 9},{i % 50}")
    path = _csv(tmp_path, lines, "many.csv")
    listed = []
    for chunk_rows in (1, 7, 64, 65536):
        report = _prepare(tmp_path, path, skip_bad_rows=True, overwrite=True, chunk_rows=chunk_rows)
        listed.append([str(b) for b in report.bad_rows])
    line_nos = [int(b.split(":")[1]) for b in listed[0]]
    assert line_nos == sorted(line_nos) and len(line_nos) == report.skipped > 10
    assert all(x == listed[0] for x in listed)


def test_stats_from_without_the_statistics_a_feature_needs(tmp_path: Path) -> None:
    from recstack.data.prepare.schema import SchemaError

    path = _csv(tmp_path, ["y,x,c", "1,2,a", "0,3,b"])
    plain = {"label": {"column": "y"}, "dense": [{"name": "x"}], "sparse": [{"name": "c"}]}
    prepare_dataset(schema_from_dict(plain), [path], tmp_path / "a", progress=False)
    std = {**plain, "dense": [{"name": "x", "transform": "standardize"}]}
    stats = tmp_path / "a" / "stats.json"
    with pytest.raises(SchemaError, match=rf"dense feature 'x' has transform 'standardize', but {stats} holds no "
                                          "mean and standard deviation for it"):
        prepare_dataset(schema_from_dict(std), [path], tmp_path / "b", stats_from=tmp_path / "a", progress=False)
    other = {**plain, "sparse": [{"name": "c", "table": "t"}]}
    with pytest.raises(SchemaError, match=rf"sparse feature 'c': {stats} holds no vocabulary for table 't' "
                                          r"\(only for c\)"):
        prepare_dataset(schema_from_dict(other), [path], tmp_path / "b", stats_from=stats, progress=False)
    assert not (tmp_path / "b").exists()
    args = ["data", "prepare", "--schema", str(tmp_path / "s.toml"), str(path), "--out", str(tmp_path / "c"),
            "--stats-from", str(tmp_path / "a"), "--no-progress"]
    (tmp_path / "s.toml").write_text('[label]\ncolumn = "y"\n[[dense]]\nname = "x"\ntransform = "standardize"\n'
                                     '[[sparse]]\nname = "c"\n')
    assert main(args) == 2


def test_a_failed_prepare_leaves_no_output_directory(tmp_path: Path) -> None:
    schema = {"label": {"column": "y"}, "sparse": [{"name": "c", "encoding": "hash", "hash_size": 10}],
              "split": {"method": "fraction", "valid": 0.2}}
    path = _csv(tmp_path, ["y,c", "1,a", "0,b", "7,c"])
    out = tmp_path / "deep" / "out"
    with pytest.raises(DataError, match="label must be 0 or 1"):
        prepare_dataset(schema_from_dict(schema), [path], out, progress=False)
    assert not out.exists()
    path.write_text("y,c\n1,a\n0,b\n1,c\n")
    prepare_dataset(schema_from_dict(schema), [path], out, progress=False)  # the rerun is not blocked
    assert sum(PreparedDataset(out / s).num_rows for s in ("train", "valid")) == 3
    # a directory that was there before stays, with its earlier output
    path.write_text("y,c\n1,a\n0,b\n7,c\n")
    with pytest.raises(DataError):
        prepare_dataset(schema_from_dict(schema), [path], out, progress=False, overwrite=True)
    assert sum(PreparedDataset(out / s).num_rows for s in ("train", "valid")) == 3


def test_inputs_without_rows_are_errors(tmp_path: Path) -> None:
    schema = {"label": {"column": "y"}, "sparse": [{"name": "c"}]}
    path = _csv(tmp_path, ["y,c"], "header_only.csv")
    with pytest.raises(DataError, match=r"header_only\.csv: empty file \(a header but no rows\)"):
        _prepare(tmp_path, path, schema)
    pq.write_table(pa.table({"y": pa.array([], pa.int64()), "c": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match=r"e\.parquet: no rows in the inputs"):
        _prepare(tmp_path, tmp_path / "e.parquet", schema)
    # an empty part among others is fine
    parts = tmp_path / "parts"
    parts.mkdir()
    (tmp_path / "e.parquet").rename(parts / "a.parquet")
    pq.write_table(pa.table({"y": [1, 0], "c": ["a", "b"]}), parts / "b.parquet")
    rep = prepare_dataset(schema_from_dict(schema), [parts], tmp_path / "parts_out", progress=False)
    assert rep.rows == {"all": 2}
    # every row skipped
    path = _csv(tmp_path, ["y,c", "7,a", "9,b"], "all_bad.csv")
    with pytest.raises(DataError, match=r"all_bad\.csv: no valid rows \(2 bad rows skipped\)"):
        _prepare(tmp_path, path, schema, skip_bad_rows=True, overwrite=True)
    fm = tmp_path / "all_bad.libfm"
    fm.write_text("1 3:x\n")
    with pytest.raises(DataError, match=r"all_bad\.libfm: no valid rows \(1 bad rows skipped\)"):
        _prepare(tmp_path, fm, FM_SCHEMA, skip_bad_rows=True, overwrite=True)
    assert not (tmp_path / "out").exists()


def test_line_numbers_in_messages(tmp_path: Path) -> None:
    # libFM: the file's lines, blank ones counted
    fm = tmp_path / "f.libfm"
    fm.write_text("1 1:1\n\n\n0 3:abc\n")
    with pytest.raises(DataError, match=r"f\.libfm:4: token 1"):
        _prepare(tmp_path, fm, FM_SCHEMA)
    # CSV: records from the header on (blank lines not counted, a quoted line break counts once)
    path = tmp_path / "q.csv"
    path.write_text('rating,age,user,item\n5,30,u1,3\n\n2,41,"u\n2",7\n4,x,u1,9\n')
    with pytest.raises(DataError, match=r"q\.csv:4: column 'age': not a number"):
        _prepare(tmp_path, path)


@pytest.mark.parametrize("transform", ["none", "standardize"])
def test_a_double_beyond_float32_is_a_bad_row_not_an_infinity(tmp_path: Path,
                                                               transform: str) -> None:
    """A Parquet double of 1e308 (finite, but no float32) in a dense column: ``recstack data
    prepare`` stops naming file, row and column (it used to store -inf standardized, inf otherwise),
    leaves no output, and with --skip-bad-rows drops that row; every stored value is finite."""
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"rating": [5.0, 2.0, 4.0, 1.0], "age": [30.0, 1e308, 41.0, -3.5e38],
                             "user": ["u1", "u2", "u1", "u3"], "item": [3, 7, 9, 4]}), path)
    schema = tmp_path / "s.toml"
    schema.write_text(f'[source]\nformat = "parquet"\n[label]\ncolumn = "rating"\nthreshold = 4.0\n'
                      f'[[dense]]\nname = "age"\ntransform = "{transform}"\n'
                      '[[sparse]]\nname = "user"\n')
    out = tmp_path / "out"
    args = [sys.executable, "-m", "recstack", "data", "prepare", "--schema", str(schema), str(path),
            "--out", str(out), "--no-progress"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert (f"{path} row 2: column 'age': not a float32 (its magnitude is above 3.4e38, the "
            "largest prepared data can hold) (got '1e+308')") in res.stderr, res.stderr
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    res = subprocess.run([*args, "--skip-bad-rows"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    dense = np.asarray(PreparedDataset(out).column("dense"))
    assert dense.shape == (2, 1) and np.isfinite(dense).all()
