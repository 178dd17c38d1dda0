"""Example click logs with a known, learnable signal, in the formats the schema readers take.

* :func:`ratings_table` — a MovieLens-shaped rating log: dense columns (``age`` with missing values,
  skewed ``num_ratings``), sparse ``user_id`` (text) and ``movie_id`` (int), multi-hot ``genres`` (text
  ``"Drama|Comedy"``) and ``history`` (list of recently watched movies, sharing the movie table), a
  ``device`` vertical, an ``event_id``, a timestamp ``ts`` and a 1..5 ``rating`` whose ``>= 4`` is the label.
  :func:`write_ratings` writes it as Parquet, CSV or TSV.
* :func:`frappe_like` — a Frappe-shaped app-usage log: 10 categorical fields with Frappe's field sizes,
  ``-1``/``1`` labels, written by :func:`write_libfm` in the libFM layout of the NFM/AFN packaging
  (``label idx:1`` once per field, indices numbered globally field after field).

Both return the true click probability of every row, so tests know the best reachable AUC.
Command line: ``python -m recstack.data.examples {ratings,frappe} --out DIR [--rows N] [--seed S]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

GENRES = ["Action", "Adventure", "Animation", "Comedy", "Crime", "Documentary", "Drama", "Fantasy", "Horror",
          "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western"]
DEVICES = ["web", "ios", "android"]
FRAPPE_FIELDS = ["user", "item", "daytime", "weekday", "isweekend", "homework", "cost", "weather", "country",
                 "city"]
FRAPPE_SIZES = [957, 4082, 7, 7, 2, 3, 2, 9, 80, 233]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _popular(rng: np.random.Generator, n: int, size: int, a: float = 1.1) -> np.ndarray:
    """Ids 0..size-1 with a Zipf-like popularity (a few ids are most of the rows)."""
    w = 1.0 / np.arange(1, size + 1) ** a
    return rng.permutation(size)[rng.choice(size, n, p=w / w.sum())]


def ratings_table(rows: int = 20000, seed: int = 0, users: int = 500, movies: int = 800,
                  start: int = 1_700_000_000) -> tuple[pa.Table, np.ndarray]:
    """-> (table, probability float64 [rows] that rating >= 4)."""
    rng = np.random.default_rng(seed)
    k = 4
    u_vec, m_vec = rng.normal(0, 0.7, (users, k)), rng.normal(0, 0.7, (movies, k))
    m_genres = [rng.choice(len(GENRES), rng.integers(1, 4), replace=False) for _ in range(movies)]
    taste = rng.normal(0, 0.8, (users, len(GENRES)))
    user = _popular(rng, rows, users, 0.8)
    movie = _popular(rng, rows, movies)
    age = rng.integers(16, 70, users).astype(np.float64)[user]
    num_ratings = np.floor(rng.lognormal(3, 1.2, users)).astype(np.int64)[user]
    hist_len = rng.integers(0, 6, rows)
    hist_flat = _popular(rng, int(hist_len.sum()), movies)
    hist_rows = np.repeat(np.arange(rows), hist_len)
    hist_mean = np.zeros((rows, k))
    np.add.at(hist_mean, hist_rows, m_vec[hist_flat])
    hist_mean /= np.maximum(hist_len, 1)[:, None]
    genre_pref = np.array([taste[u, m_genres[m]].mean() for u, m in zip(user, movie, strict=True)])
    score = ((u_vec[user] * m_vec[movie]).sum(1) + genre_pref + (hist_mean * m_vec[movie]).sum(1)
             + 0.4 * (age - 40) / 15 - 0.2 * np.log1p(num_ratings) + 0.5)
    # rating = clip(round(3.2 + score + logistic noise)), so P(rating >= 4) = sigmoid((score - 0.3) / 0.6)
    noise = 0.6 * np.log(1 / rng.uniform(1e-9, 1, rows) - 1)
    rating = np.clip(np.round(3.2 + score + noise), 1, 5).astype(np.int64)
    prob = _sigmoid((score - 0.3) / 0.6)
    age_col = pa.array(age, mask=rng.random(rows) < 0.05)  # 5% unknown age
    genres = pa.array(["|".join(GENRES[g] for g in m_genres[m]) for m in movie],
                      mask=rng.random(rows) < 0.03)  # some movies have no genre data
    offsets = np.concatenate([[0], np.cumsum(hist_len)]).astype(np.int32)
    table = pa.table({
        "event_id": pa.array(np.arange(rows, dtype=np.int64) + 10_000),
        "ts": pa.array(start + np.sort(rng.integers(0, 30 * 86400, rows)), pa.timestamp("s")),
        "user_id": pa.array([f"u{u}" for u in user]),
        "movie_id": pa.array(movie.astype(np.int64)),
        "genres": genres,
        "history": pa.ListArray.from_arrays(pa.array(offsets), pa.array(hist_flat.astype(np.int64))),
        "age": age_col,
        "num_ratings": pa.array(num_ratings),
        "device": pa.array(np.array(DEVICES)[rng.integers(0, 3, rows)]),
        "rating": pa.array(rating),
    })
    return table, prob


def as_text_table(table: pa.Table, separator: str = "|") -> pa.Table:
    """List columns joined with ``separator`` and timestamps as ISO text, as a CSV export would hold them."""
    cols = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_list(col.type):
            col = pa.array([None if v is None else separator.join(map(str, v)) for v in col.to_pylist()],
                           pa.string())
        elif pa.types.is_timestamp(col.type):
            col = pa.array([None if v is None else v.isoformat(sep=" ") for v in col.to_pylist()], pa.string())
        cols[name] = col
    return pa.table(cols)


def write_ratings(path: str | Path, table: pa.Table, row_group_size: int = 65536) -> Path:
    """Write as Parquet, CSV or TSV by the file suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=row_group_size)
    else:
        delim = "\t" if path.suffix == ".tsv" else ","
        pcsv.write_csv(as_text_table(table), path,
                       pcsv.WriteOptions(delimiter=delim, quoting_style="needed" if delim == "," else "none"))
    return path


def frappe_like(rows: int = 20000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (labels int [rows] in {-1, 1}, global indices int64 [rows, 10], probability float64 [rows]).

    The click logit is an FM over the fields: per-value biases plus the dot products of user, item and
    context factors; about one row in three is positive, as in Frappe (one click, two sampled negatives)."""
    rng = np.random.default_rng(seed)
    k = 6
    local = np.stack([_popular(rng, rows, n, 1.0 if n > 50 else 0.3) for n in FRAPPE_SIZES], 1)
    offsets = np.concatenate([[0], np.cumsum(FRAPPE_SIZES)[:-1]])
    glob = local + offsets
    total = sum(FRAPPE_SIZES)
    bias = rng.normal(0, 0.6, total)
    vec = rng.normal(0, 0.55, (total, k))
    v = vec[glob]  # [rows, 10, k]
    s = v.sum(1)
    pair = 0.5 * ((s * s).sum(1) - (v * v).sum((1, 2)))  # sum over field pairs of <v_i, v_j>
    logit = bias[glob].sum(1) + pair
    logit = (logit - logit.mean()) / logit.std() * 2.0 - 0.9
    prob = _sigmoid(logit)
    labels = np.where(rng.random(rows) < prob, 1, -1)
    return labels, glob.astype(np.int64), prob


def write_libfm(path: str | Path, labels: np.ndarray, indices: np.ndarray, values: np.ndarray | None = None,
                fields: np.ndarray | None = None) -> Path:
    """One ``label idx:val ...`` line per row (``field:idx:val`` when ``fields`` [rows, k] is given).
    values [rows, k] default to 1."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vals = np.ones(indices.shape) if values is None else values
    with open(path, "w") as f:
        for r in range(len(labels)):
            if fields is None:
                toks = [f"{i}:{v:g}" for i, v in zip(indices[r], vals[r], strict=True)]
            else:
                toks = [f"{a}:{i}:{v:g}" for a, i, v in zip(fields[r], indices[r], vals[r], strict=True)]
            f.write(f"{labels[r]:g} " + " ".join(toks) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m recstack.data.examples", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["ratings", "frappe"])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--rows", type=int, default=0, help="rows (default 300000 ratings, 288609 frappe)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.kind == "ratings":
        table, _ = ratings_table(args.rows or 300_000, args.seed, users=6000, movies=3700)
        write_ratings(out / "ratings.parquet", table)
        print(f"wrote {table.num_rows} rows to {out / 'ratings.parquet'}")
        return
    labels, idx, _ = frappe_like(args.rows or 288_609, args.seed)
    n = len(labels)
    cut = [0, int(n * 0.7), int(n * 0.9), n]  # Frappe's packaged train / validation / test proportions
    for name, lo, hi in zip(("train", "validation", "test"), cut[:-1], cut[1:], strict=True):
        write_libfm(out / f"frappe.{name}.libfm", labels[lo:hi], idx[lo:hi])
    print(f"wrote {n} rows to {out}/frappe.{{train,validation,test}}.libfm")


if __name__ == "__main__":
    main()
