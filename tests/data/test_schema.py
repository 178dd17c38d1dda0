"""Schema files: loading, validation errors that name file and key, TOML round trip, inference."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from conftest import REPO

from recstack.data.examples import frappe_like, ratings_table, write_libfm, write_ratings
from recstack.data.prepare.infer import infer_schema
from recstack.data.prepare.inspect import inspect_file
from recstack.data.prepare.schema import (
    Schema,
    SchemaError,
    detect_format,
    load_schema,
    schema_from_dict,
    schema_to_toml,
    split_time,
)

SCHEMAS = REPO / "configs" / "schemas"


def test_repo_schemas_load_and_round_trip() -> None:
    files = sorted(SCHEMAS.glob("*.toml"))
    assert {f.name for f in files} >= {"frappe_libfm.toml", "ratings_parquet.toml"}
    for f in files:
        sch = load_schema(f)
        again = schema_from_dict(tomllib.loads(schema_to_toml(sch)), "round trip")
        assert again == sch, f


def test_ratings_schema_content() -> None:
    sch = load_schema(SCHEMAS / "ratings_parquet.toml")
    assert sch.label.threshold == 4.0 and (sch.label.min, sch.label.max) == (1.0, 5.0)
    assert [d.transform for d in sch.dense] == ["standardize", "log1p"]
    tables = sch.tables()
    assert [s.name for s in tables["movie"]] == ["movie", "history"]
    assert sch.sparse[0].column == "user_id" and sch.sparse[1].column == "movie_id"
    assert split_time(sch.split.valid_from) == 1701993600  # 2023-12-08T00:00:00Z
    assert sch.input_columns()[:3] == ["rating", "age", "num_ratings"]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[label]\ncolum = 'y'\n", r"s\.toml: \[label\]: unknown key 'colum'"),
        ("[labels]\ncolumn = 'y'\n", r"s\.toml: unknown section 'labels'"),
        ("[[dense]]\nname = 'a'\ntransform = 'log'\n", r"dense 'a': transform 'log' is not one of"),
        ("[[dense]]\nname = 'a'\nfill = 'x'\n", r"dense\[0\]\.fill: expected float"),
        ("[[sparse]]\nname = 'a'\nencoding = 'hash'\n", r"sparse 'a': hash encoding needs hash_size >= 2"),
        ("[[sparse]]\nname = 'a'\nencoding = 'identity'\n", r"sparse 'a': identity encoding needs size"),
        ("[[sparse]]\nname = 'a'\npooling = 'max'\n", r"sparse 'a': pooling 'max'"),
        ("[[sparse]]\nname = 'a'\nweight_column = 'w'\n", r"weight_column needs multi_hot"),
        ("[[sparse]]\nname = 'a b'\n", r"sparse\[0\]: name 'a b'"),
        ("[[dense]]\nname = 'a'\n[[sparse]]\nname = 'a'\n", r"sparse feature 'a' is declared twice"),
        ("[[sparse]]\nname = 'a'\ntable = 't'\n[[sparse]]\nname = 'b'\ntable = 't'\nmin_freq = 3\n",
         r"table 't': features a, b share it but declare different"),
        ("[split]\nmethod = 'time'\nvalid_from = 5\n", r"needs columns\.timestamp"),
        ("[split]\nmethod = 'fraction'\nvalid = 0.6\ntest = 0.5\n", r"must be fractions summing below 1"),
        ("[source]\nformat = 'xls'\n", r"source\.format 'xls'"),
        ("[source]\nfield_ranges = { a = [5, 2] }\n", r"field_ranges\.a"),
        ("[label]\ncolumn = 'y'\nmin = 3\nmax = 1\n", r"min 3\.0 is above max 1\.0"),
        ("[label\n", r"invalid TOML"),
        ("[[dense]]\nname = 'a'\n", r"no \[\[sparse\]\] feature"),
    ],
)
def test_schema_errors_name_file_and_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        load_schema(_write(tmp_path, text))


def test_missing_schema_file_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="not found"):
        load_schema(tmp_path / "nope.toml")
    with pytest.raises(SchemaError, match="cannot tell the format"):
        detect_format(tmp_path / "data.bin")
    assert detect_format(tmp_path / "x.csv.gz") == "csv" and detect_format(tmp_path / "x.svm") == "libfm"


def test_defaults_fill_columns_and_tables() -> None:
    sch = schema_from_dict({"sparse": [{"name": "a"}, {"name": "b", "column": "B", "table": "a"}]})
    assert isinstance(sch, Schema)
    assert [s.column for s in sch.sparse] == ["a", "B"]
    assert list(sch.tables()) == ["a"] and len(sch.tables()["a"]) == 2
    assert sch.input_columns() == ["label", "a", "B"]


def test_infer_schema_from_parquet(tmp_path: Path) -> None:
    table, _ = ratings_table(3000, seed=1)
    path = write_ratings(tmp_path / "r.parquet", table)
    report = inspect_file([path])
    sch, comments = infer_schema(report)
    assert sch.label.column == "rating" and sch.label.threshold == 4.0  # upper quarter of 1..5
    assert sch.columns.timestamp == "ts" and sch.columns.example_id == "event_id"
    dense = {d.name: d.transform for d in sch.dense}
    sparse = {s.name: s for s in sch.sparse}
    assert dense == {"age": "standardize", "num_ratings": "log1p"}
    assert sparse["genres"].multi_hot and sparse["genres"].separator == "|"
    assert sparse["history"].multi_hot and not sparse["user_id"].multi_hot
    assert set(sparse) == {"user_id", "movie_id", "genres", "history", "device"}
    missing = 100 * table.column("age").null_count / table.num_rows
    assert comments["age"].startswith(f"age: float, {missing:.1f}% missing, ")
    # what is printed for editing loads back to the same schema
    text = schema_to_toml(sch, comments)
    assert "# age: float" in text
    assert schema_from_dict(tomllib.loads(text)) == sch


def test_infer_schema_from_libfm_positions(tmp_path: Path) -> None:
    labels, idx, _ = frappe_like(500, seed=2)
    path = write_libfm(tmp_path / "f.libfm", labels, idx)
    sch, _ = infer_schema(inspect_file([path]))
    assert sch.source.format == "libfm" and sch.source.fields == [f"field{i}" for i in range(10)]
    assert sch.label.threshold == 0.0 and not sch.dense
    assert [s.name for s in sch.sparse] == sch.source.fields


def test_inferred_feature_names_are_valid_and_distinct(tmp_path: Path) -> None:
    path = tmp_path / "names.csv"
    header = ["label", "café", "été", "", "-x", "a b", "a_b", "a_b_2", "ok-name"]
    rows = [["1", "1.5", "x", "y", "z", "p", "q", "r", "s"], ["0", "2.5", "w", "y", "z", "p", "q", "r", "t"]]
    path.write_text("\n".join(",".join(r) for r in [header, *rows]) + "\n", encoding="utf-8")
    sch, _ = infer_schema(inspect_file([path]))
    features = {f.column: f.name for f in [*sch.dense, *sch.sparse]}
    assert features == {"café": "caf_", "été": "_t_", "-x": "col-x", "a b": "a_b_3", "a_b": "a_b",
                        "a_b_2": "a_b_2", "ok-name": "ok-name"}  # the nameless column is left out
    text = schema_to_toml(sch)
    again = schema_from_dict(tomllib.loads(text))  # validates
    assert again == sch
    (tmp_path / "s.toml").write_text(text, encoding="utf-8")
    from recstack.data.prepare.schema_prepare import prepare_dataset

    prepare_dataset(load_schema(tmp_path / "s.toml"), [path], tmp_path / "out", progress=False)
