"""Which recipe in ``configs/recipes/`` fits a data layout: ``recstack data inspect`` suggests one.

The layouts, checked in this order:
- a multi-hot feature (a history or genre list): ``ratings_history.toml`` (bottom MLP for the dense features,
  row-wise Adagrad embeddings, Adam for the dense part);
- no dense feature (libFM/libSVM files, categorical-only logs): ``categorical.toml`` (no bottom MLP);
- dense and single-valued categorical features (the Criteo layout): ``criteo.toml`` (the DLRM reference setup).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pyarrow: only when a report is at hand
    from recstack.data.prepare.inspect import PreparedReport
    from recstack.data.prepare.schema import Schema

RECIPE_DIR = "configs/recipes"


def _recipe(dense: int, multi_hot: bool) -> tuple[str, str]:
    if multi_hot:
        return "ratings_history.toml", "multi-hot features"
    if dense == 0:
        return "categorical.toml", "categorical features only"
    return "criteo.toml", "dense and single-valued categorical features"


def recipe_for_schema(schema: Schema) -> tuple[str, str]:
    """-> (recipe path, the layout in words) for raw data described by ``schema`` (inferred or written)."""
    name, why = _recipe(len(schema.dense), any(s.multi_hot for s in schema.sparse))
    return f"{RECIPE_DIR}/{name}", why


def recipe_for_prepared(report: PreparedReport) -> tuple[str, str]:
    """-> (recipe path, the layout in words) for a prepared directory."""
    name, why = _recipe(len(report.dense), any(s["multi_hot"] for s in report.sparse))
    return f"{RECIPE_DIR}/{name}", why


def recipe_line(recipe: tuple[str, str]) -> str:
    path, why = recipe
    return f"suggested recipe ({why}): recstack train --config {path} --set data.train=... --set data.eval=..."
