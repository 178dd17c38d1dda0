"""``recstack data inspect``: column statistics of raw files, the tables of prepared data, the CLI."""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import REPO

from recstack.cli.main import main
from recstack.data.examples import frappe_like, ratings_table, write_libfm, write_ratings
from recstack.data.prepare import inspect as insp
from recstack.data.prepare.inspect import Cardinality, inspect_file, inspect_prepared
from recstack.data.prepare.schema import LabelSpec, load_schema, schema_from_dict
from recstack.data.prepare.schema_prepare import prepare_dataset
from recstack.data.prepared_dataset import PreparedDataset
from recstack.tune.space import space_path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("inspect")
    table, _ = ratings_table(4000, seed=7)
    return {"table": table, "parquet": write_ratings(d / "r.parquet", table), "csv": write_ratings(d / "r.csv", table),
            "dir": d}


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_column_statistics(files: dict, fmt: str) -> None:
    t = files["table"]
    r = inspect_file([files[fmt]], label=LabelSpec(column="rating", threshold=4.0))
    assert r.rows == t.num_rows and r.format == fmt
    age, user, genres, hist = (r.column(c) for c in ("age", "user_id", "genres", "history"))
    assert age.kind == ("float" if fmt == "parquet" else "int")  # CSV writes 56.0 as 56
    assert age.missing == t.column("age").null_count
    ages = t.column("age").drop_null().to_numpy()
    assert (age.min, age.max) == (ages.min(), ages.max())
    users = Counter(t.column("user_id").to_pylist())
    assert user.distinct.is_exact and user.distinct.value() == len(users)
    assert user.top(3) == users.most_common(3)
    assert genres.separator == "|" and genres.kind == "text"
    names = Counter(g for v in t.column("genres").to_pylist() if v for g in v.split("|"))
    assert genres.distinct.value() == 16 and genres.top(1) == names.most_common(1)
    assert genres.missing == t.column("genres").null_count
    lens = [len(v) for v in t.column("history").to_pylist()]
    assert hist.values == sum(lens) and hist.missing == lens.count(0)
    assert r.label == "rating" and r.label_rate == pytest.approx(np.mean(np.array(t.column("rating")) >= 4))
    assert r.column("num_ratings").kind == "int"


def test_label_rate_guesses() -> None:
    for values, rate, rule in (([0, 1, 1, 0], 0.5, "== 1"), ([-1, 1, 1, 1], 0.75, "-1/1")):
        c = insp.ColumnStats("y")
        c.update(pa.array(values))
        got, text = insp._label_rate(c, None)
        assert got == rate and text.startswith(rule)


def test_sketched_cardinality(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(insp, "EXACT_LIMIT", 1000)
    rng = np.random.default_rng(0)
    for n in (500, 20_000, 200_000):
        c = Cardinality()
        h = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
        for part in np.array_split(np.concatenate([h, h[: n // 2]]), 7):  # repeats must not count
            c.update(part)
        assert c.is_exact == (n <= 1000)
        assert abs(c.value() / n - 1) <= (0 if n <= 1000 else 0.05), (n, c.value())


def test_libfm_positions_and_field_ranges(tmp_path: Path) -> None:
    labels, idx, _ = frappe_like(800, seed=3)
    path = write_libfm(tmp_path / "f.libfm", labels, idx)
    r = inspect_file([path])
    assert [c.name for c in r.columns if "#" not in c.name] == ["label", *(f"field{i}" for i in range(10))]
    assert r.column("field0#value").top(2) == [("1", 800)]  # every pair's value is 1
    assert r.column("field2").min >= 5039 and r.column("field2").max < 5046  # Frappe's daytime indices
    assert r.label_rate == pytest.approx((labels > 0).mean()) and r.label_rule.startswith("-1/1")


def test_prepared_report_tables_after_sharing_and_cap(files: dict, tmp_path: Path) -> None:
    sch = load_schema(REPO / "configs" / "schemas" / "ratings_parquet.toml")
    prepare_dataset(sch, [files["parquet"]], tmp_path / "p", progress=False)
    r = inspect_prepared(tmp_path / "p" / "train", max_table_size=100, embedding_dim=8)
    tables = {t["name"]: t for t in r.tables}
    assert list(tables) == ["user", "movie", "genres", "device"]
    assert tables["movie"]["features"] == ["movie", "history"] and tables["movie"]["rows"] == 100
    assert tables["genres"]["rows"] == 64 and tables["genres"]["mib"] == 64 * 8 * 4 / 2**20
    hist = next(s for s in r.sparse if s["name"] == "history")
    assert hist["multi_hot"] and hist["pooling"] == "mean" and hist["mean_ids"] >= 1.0
    assert r.rows == len(PreparedDataset(tmp_path / "p" / "train"))


def test_cli_inspect_and_infer(files: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["data", "inspect", str(files["csv"]), "--rows", "1000"]) == 0
    out = capsys.readouterr().out
    assert "1,000 rows, 10 columns" in out and "user_id" in out and "text[|]" in out
    schema = tmp_path / "inferred.toml"
    assert main(["data", "inspect", str(files["parquet"]), "--infer-schema", str(schema)]) == 0
    inferred = load_schema(schema)
    assert inferred.label.column == "rating" and {s.name for s in inferred.sparse} >= {"user_id", "genres"}
    report = prepare_dataset(inferred, [files["parquet"]], tmp_path / "prep", progress=False)
    assert report.total_rows == files["table"].num_rows
    assert main(["data", "inspect", str(tmp_path / "prep")]) == 0
    assert "embedding tables the model gets" in capsys.readouterr().out
    assert main(["data", "inspect", str(files["parquet"]), "--infer-schema", "-"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Inferred") and schema_from_dict(tomllib.loads(printed)) == inferred


def test_format_option_reads_a_libfm_file_without_a_libfm_name(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    labels, idx, _ = frappe_like(300, seed=5)
    path = write_libfm(tmp_path / "f.libfm", labels, idx).rename(tmp_path / "frappe.txt")
    assert main(["data", "inspect", str(path)]) == 2  # the name says nothing: the error points at --format
    assert "--format" in capsys.readouterr().err
    assert main(["data", "inspect", str(path), "--format", "libfm"]) == 0
    out = capsys.readouterr().out
    assert "libfm, 300 rows" in out and "field9" in out


def test_inspect_suggests_the_recipe_of_the_layout(files: dict, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    labels, idx, _ = frappe_like(300, seed=5)
    libfm = write_libfm(tmp_path / "f.libfm", labels, idx)
    cases = [([str(libfm)], "configs/recipes/categorical.toml"),
             ([str(files["parquet"])], "configs/recipes/ratings_history.toml")]  # genres and history lists
    sch = load_schema(REPO / "configs" / "schemas" / "ratings_parquet.toml")
    prepare_dataset(sch, [files["parquet"]], tmp_path / "p", progress=False)
    cases.append(([str(tmp_path / "p" / "train")], "configs/recipes/ratings_history.toml"))
    criteo_schema = REPO / "configs" / "schemas" / "criteo_csv.toml"
    rows = ["label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))]
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows.append(f"{rng.integers(2)}," + ",".join(str(rng.integers(100)) for _ in range(13)) + ","
                    + ",".join(f"{rng.integers(1 << 30):08x}" for _ in range(26)))
    csv = tmp_path / "criteo.csv"
    csv.write_text("\n".join(rows) + "\n")
    cases.append(([str(csv), "--schema", str(criteo_schema)], "configs/recipes/criteo_small.toml"))
    # Only the first rows read: the size is not known, so the recipe for Criteo-sized logs.
    cases.append(([str(csv), "--schema", str(criteo_schema), "--rows", "20"], "configs/recipes/criteo.toml"))
    # The tabular layouts of bench/quality.py's other sources (a few categorical fields, one or a few numeric
    # ones): with their schemas, and as a user's raw file with none (the schema inferred).
    clothing = tmp_path / "clothing.csv"
    clothing.write_text("label,clothing_id,age,division,department,class_name,positive_feedback\n" + "".join(
        f"{int(rng.integers(2))},{rng.integers(1000)},{rng.integers(18, 90)},General,Dresses,Knits,"
        f"{rng.random():.3f}\n" for _ in range(60)))
    cases.append(([str(clothing), "--schema", str(REPO / "configs" / "schemas" / "clothing_csv.toml")],
                  "configs/recipes/criteo_small.toml"))
    cases.append(([str(clothing)], "configs/recipes/criteo_small.toml"))
    adult = tmp_path / "adult.csv"
    adult.write_text("label,workclass,education,marital_status,occupation,relationship,race,gender,native_country,"
                     "age,fnlwgt,education_num,capital_gain,capital_loss,hours_per_week\n" + "".join(
                         f"{int(rng.integers(2))}," + ",".join(f"v{rng.integers(5)}" for _ in range(8)) + ","
                         + ",".join(f"{rng.random() * 10:.3f}" for _ in range(6)) + "\n" for _ in range(60)))
    cases.append(([str(adult), "--schema", str(REPO / "configs" / "schemas" / "adult_csv.toml")],
                  "configs/recipes/criteo_small.toml"))
    for args, recipe in cases:
        assert main(["data", "inspect", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        line = next(x for x in lines if x.startswith("suggested recipe"))
        assert f"--config {recipe} " in line and (REPO / recipe).is_file()
        tune = lines[lines.index(line) + 1]  # and the tune command beside it, with the recipe's search space
        assert tune.startswith("or tune it") and f"recstack tune --config {recipe} " in tune
        assert space_path(REPO / recipe).is_file()


def test_criteo_layout_recipe_depends_on_the_row_count() -> None:
    from recstack.cli.recipes import SMALL_CRITEO_ROWS, recipe_for_schema
    sch = load_schema(REPO / "configs" / "schemas" / "criteo_csv.toml")
    assert recipe_for_schema(sch, SMALL_CRITEO_ROWS - 1)[0] == "configs/recipes/criteo_small.toml"
    assert recipe_for_schema(sch, SMALL_CRITEO_ROWS)[0] == "configs/recipes/criteo.toml"
    assert recipe_for_schema(sch, None)[0] == "configs/recipes/criteo.toml"
