"""Which recipe in ``configs/recipes/`` fits a data layout: ``recstack data inspect`` suggests one.

The layouts, checked in this order:
- a multi-hot feature (a history or genre list): ``ratings_history.toml`` (bottom MLP for the dense features,
  row-wise Adagrad embeddings, Adam for the dense part);
- no dense feature (libFM/libSVM files, categorical-only logs): ``categorical.toml`` (no bottom MLP);
- dense and single-valued categorical features (the Criteo layout, and tabular logs such as ``bench/quality.py``'s
  clothing reviews and census table): ``criteo_small.toml`` below
  ``SMALL_CRITEO_ROWS`` rows (Adam, row-wise Adagrad with L2, several epochs with early stopping), else
  ``criteo.toml`` (the DLRM reference setup, one epoch of SGD, for Criteo-sized logs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pyarrow: only when a report is at hand
    from recstack.data.prepare.inspect import PreparedReport
    from recstack.data.prepare.schema import Schema

RECIPE_DIR = "configs/recipes"
# Below this many rows one epoch of criteo.toml's SGD is too few steps to fit the model (12 steps on the
# 1,600-row Criteo sample: validation AUC 0.578 against 0.698 for criteo_small.toml, bench/results/
# tune_criteo_small.json); Criteo Kaggle (45M rows) is what criteo.toml is the reference setup for.
SMALL_CRITEO_ROWS = 10_000_000


def _recipe(dense: int, multi_hot: bool, rows: int | None) -> tuple[str, str]:
    """``rows`` None: not known (a file inspected with ``--rows``), which gets the large-data recipe."""
    if multi_hot:
        return "ratings_history.toml", "multi-hot features"
    if dense == 0:
        return "categorical.toml", "categorical features only"
    if rows is not None and rows < SMALL_CRITEO_ROWS:
        return "criteo_small.toml", f"dense and single-valued categorical features, {rows:,} rows"
    return "criteo.toml", "dense and single-valued categorical features" + (
        f", {rows:,} rows" if rows is not None else "")


def recipe_for_schema(schema: Schema, rows: int | None) -> tuple[str, str]:
    """-> (recipe path, the layout in words) for raw data described by ``schema`` (inferred or written);
    ``rows``: the files' row count, None when only the first rows were read."""
    name, why = _recipe(len(schema.dense), any(s.multi_hot for s in schema.sparse), rows)
    return f"{RECIPE_DIR}/{name}", why


def recipe_for_prepared(report: PreparedReport) -> tuple[str, str]:
    """-> (recipe path, the layout in words) for a prepared directory."""
    name, why = _recipe(len(report.dense), any(s["multi_hot"] for s in report.sparse), report.rows)
    return f"{RECIPE_DIR}/{name}", why


def recipe_line(recipe: tuple[str, str]) -> str:
    """Two lines: the recipe's train command, and the tune command that searches its options (its space in
    ``configs/recipes/tune/``) on the user's validation split."""
    path, why = recipe
    data = "--set data.train=... --set data.eval=..."
    return (f"suggested recipe ({why}): recstack train --config {path} {data}\n"
            f"or tune it on your validation data: recstack tune --config {path} --output-dir runs/tune {data} "
            "--time-budget 20m")
