"""MovieLens-100k as a real stream: ratings in time order, label = rating >= threshold, verticals by genre.

Two layouts of the same data are read:

* the GroupLens files: ``u.data`` (user TAB item TAB rating TAB timestamp, no header), ``u.item``
  (``|``-separated, Latin-1: id, title, release date, video date, URL, then 19 genre flags) and optionally
  ``u.user`` (id|age|gender|occupation|zip);
* RecBole's atomic files: ``<name>.inter`` (header ``user_id:token item_id:token rating:float
  timestamp:float``, TAB-separated), ``<name>.item`` (``item_id``, ``release_year``, ``class`` = genres
  separated by spaces) and optionally ``<name>.user`` (``user_id``, ``age``, ``gender``, ``occupation``).

Both give the same prepared data set: rows sorted by timestamp (ties keep file order), ``example_id`` =
the rating's position in the ratings file, ``timestamp`` in seconds, ``vertical`` = the first genre group
(in config order) that shares a genre with the movie. Features: dense ``age`` / 100 and (``year`` - 1900)
/ 100 (0 when unknown); sparse ``user``, ``item`` (vocabularies of the sorted ids, row 0 = missing),
``genres`` (multi-hot, mean pooling), ``gender``, ``occupation``, ``age_bucket``. Bad input raises
``DataError`` naming the file, the line and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recstack.data.format import SparseFeatureSpec
from recstack.data.prepare.readers.base import DataError
from recstack.data.prepared_writer import PreparedWriter

GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
AGE_EDGES = (18, 25, 35, 45, 50, 56)  # the MovieLens-1M age groups: <18, 18-24, ..., 56+


def _default_verticals() -> list[dict[str, Any]]:
    return [
        {"name": "drama", "genres": ["Drama", "Documentary", "War", "Film-Noir"]},
        {"name": "comedy", "genres": ["Comedy", "Romance", "Musical", "Children's", "Animation", "Fantasy"]},
        {"name": "action", "genres": ["Action", "Adventure", "Sci-Fi", "Thriller", "Western", "Crime", "Horror",
                                      "Mystery"]},
    ]


@dataclass
class MovieLensConfig:
    """``layout``: auto | udata | recbole. ``other``: movies in no vertical form one more vertical
    (``other``) instead of being dropped."""

    path: str = ""
    layout: str = "auto"
    name: str = ""  # RecBole file stem; empty: the directory's only *.inter file
    threshold: float = 4.0
    verticals: list[dict[str, Any]] = field(default_factory=_default_verticals)
    other: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("auto", "udata", "recbole"):
            raise ValueError(f"movielens.layout: {self.layout!r} is not one of auto, udata, recbole")
        for i, v in enumerate(self.verticals):
            if set(v) != {"name", "genres"}:
                raise ValueError(f"movielens.verticals[{i}]: needs exactly the keys name, genres, got {sorted(v)}")
            bad = [g for g in v["genres"] if g not in GENRES]
            if bad:
                raise ValueError(f"movielens.verticals[{i}].genres: unknown genres {bad} (known: {GENRES})")


@dataclass
class Raw:
    """Ratings [N] as read, items and users by their id token."""

    ratings_file: str
    user: list[str]
    item: list[str]
    rating: np.ndarray  # [N] float64
    timestamp: np.ndarray  # [N] int64 seconds
    line: np.ndarray  # [N] int64 rating number, 1-based (the line in u.data; the line - 1 in .inter)
    item_genres: dict[str, list[str]]
    item_year: dict[str, int | None]
    user_info: dict[str, tuple[int | None, str, str]]  # age, gender, occupation


def _number(text: str, where: str, name: str, kind=float) -> Any:
    try:
        return kind(float(text)) if kind is int else kind(text)
    except ValueError:
        raise DataError(where, name, text, f"expected a number ({kind.__name__})") from None


def _lines(path: Path, encoding: str = "utf-8"):
    """(line number, text) of the non-empty lines; Latin-1 when the file is not UTF-8 (as u.item is)."""
    raw = path.read_bytes()
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    for i, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield i, line


def _ratings(path: Path, rows, where_fields: tuple[int, int, int, int]) -> tuple:
    users, items, rating, ts, lines = [], [], [], [], []
    iu, ii, ir, it = where_fields
    for n, fields in rows:
        where = f"{path}:{n}"
        users.append(fields[iu].strip())
        items.append(fields[ii].strip())
        rating.append(_number(fields[ir], where, "rating"))
        ts.append(_number(fields[it], where, "timestamp", int))
        lines.append(n)
    return users, items, np.array(rating, np.float64), np.array(ts, np.int64), np.array(lines, np.int64)


def _split(path: Path, sep: str, want: int, names: str, skip_header: bool = False, encoding: str = "utf-8"):
    for n, line in _lines(path, encoding):
        if skip_header and n == 1:
            continue
        fields = line.split(sep)
        if len(fields) != want:
            raise DataError(f"{path}:{n}", None, None,
                            f"expected {want} {sep!r}-separated fields ({names}), got {len(fields)}")
        yield n, fields


def _year(text: str, where: str, name: str) -> int | None:
    """A release year; empty or a word (RecBole's ml-100k writes ``unkonwn``) means unknown."""
    text = text.strip()
    return None if not text or text.isalpha() else _number(text, where, name, int)


def _age(text: str, where: str) -> int | None:
    return _number(text, where, "age", int) if text.strip() else None


def read_udata(directory: Path) -> Raw:
    d = Path(directory)
    data = d / "u.data"
    users, items, rating, ts, lines = _ratings(
        data, _split(data, "\t", 4, "user, item, rating, timestamp"), (0, 1, 2, 3))
    genres, years = {}, {}
    for n, f in _split(d / "u.item", "|", 5 + len(GENRES), "id, title, date, video date, URL, 19 genre flags",
                       encoding="latin-1"):
        flags = f[5:]
        bad = [x for x in flags if x not in ("0", "1")]
        if bad:
            raise DataError(f"{d / 'u.item'}:{n}", "genre flags", bad[0], "expected 0 or 1")
        genres[f[0]] = [g for g, x in zip(GENRES, flags, strict=True) if x == "1"]
        years[f[0]] = _year(f[2].strip()[-4:], f"{d / 'u.item'}:{n}", "release date")
    info = {}
    if (d / "u.user").is_file():
        for n, f in _split(d / "u.user", "|", 5, "id, age, gender, occupation, zip"):
            info[f[0]] = (_age(f[1], f"{d / 'u.user'}:{n}"), f[2], f[3])
    return Raw(str(data), users, items, rating, ts, lines, genres, years, info)


def _atomic(path: Path, required: tuple[str, ...]):
    """Rows of a RecBole atomic file as {field name: text}; the header gives ``name:type`` per column."""
    rows = iter(_lines(path))
    try:
        _, header = next(rows)
    except StopIteration:
        raise DataError(str(path), None, None, "empty file (no header)") from None
    names = [h.split(":", 1)[0].strip() for h in header.split("\t")]
    missing = [r for r in required if r not in names]
    if missing:
        raise DataError(f"{path}:1", None, header, f"header lacks the fields {missing}")
    for n, line in rows:
        fields = line.split("\t")
        if len(fields) != len(names):
            raise DataError(f"{path}:{n}", None, None, f"expected {len(names)} TAB-separated fields, got {len(fields)}")
        yield n, dict(zip(names, fields, strict=True))


def read_recbole(directory: Path, name: str = "") -> Raw:
    d = Path(directory)
    if not name:
        found = sorted(d.glob("*.inter"))
        if len(found) != 1:
            raise FileNotFoundError(f"{d}: expected one *.inter file, found {[p.name for p in found]}")
        name = found[0].stem
    inter = d / f"{name}.inter"
    rows = ((n, [r["user_id"], r["item_id"], r["rating"], r["timestamp"]])
            for n, r in _atomic(inter, ("user_id", "item_id", "rating", "timestamp")))
    users, items, rating, ts, lines = _ratings(inter, rows, (0, 1, 2, 3))
    lines = lines - 1  # the header is not a rating: line k of the file is rating k - 1, as in u.data
    genres, years = {}, {}
    for n, r in _atomic(d / f"{name}.item", ("item_id", "class")):
        gs = r["class"].split()
        bad = [g for g in gs if g not in GENRES]
        if bad:
            raise DataError(f"{d / f'{name}.item'}:{n}", "class", bad[0], f"unknown genre (known: {GENRES})")
        genres[r["item_id"]] = gs
        years[r["item_id"]] = _year(r.get("release_year", ""), f"{d / f'{name}.item'}:{n}", "release_year")
    info = {}
    if (d / f"{name}.user").is_file():
        for n, r in _atomic(d / f"{name}.user", ("user_id", "age", "gender", "occupation")):
            info[r["user_id"]] = (_age(r["age"], f"{d / f'{name}.user'}:{n}"), r["gender"], r["occupation"])
    return Raw(str(inter), users, items, rating, ts, lines, genres, years, info)


def read_movielens(cfg: MovieLensConfig) -> Raw:
    d = Path(cfg.path)
    layout = cfg.layout
    if layout == "auto":
        layout = "udata" if (d / "u.data").is_file() else "recbole"
    return read_udata(d) if layout == "udata" else read_recbole(d, cfg.name)


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Sorted distinct tokens (numerically when all are integers) -> rows 1.. (row 0 = missing)."""
    uniq = sorted(set(tokens), key=lambda t: (0, int(t), "") if t.lstrip("-").isdigit() else (1, 0, t))
    return {t: i + 1 for i, t in enumerate(uniq)}


def prepare_movielens(cfg: MovieLensConfig, out_dir: Path, overwrite: bool = False) -> Path:
    """Read ``cfg.path`` and write the prepared stream to ``out_dir``; -> ``out_dir``."""
    raw = read_movielens(cfg)
    where = raw.ratings_file
    for k, it in enumerate(raw.item):
        if it not in raw.item_genres:
            raise DataError(f"{where}:{raw.line[k] + (1 if where.endswith('.inter') else 0)}", "item", it,
                            "this item is not in the item file")
    names = [v["name"] for v in cfg.verticals] + (["other"] if cfg.other else [])
    groups = [set(v["genres"]) for v in cfg.verticals]
    item_vertical = {}
    for it, gs in raw.item_genres.items():
        v = next((i for i, g in enumerate(groups) if g & set(gs)), len(groups) if cfg.other else -1)
        item_vertical[it] = v
    vertical = np.array([item_vertical[it] for it in raw.item], np.int64)
    order = np.lexsort((raw.line, raw.timestamp))  # time order; ties keep file order
    order = order[vertical[order] >= 0]  # movies in no vertical are dropped unless cfg.other
    n = len(order)
    users, items = [raw.user[k] for k in order], [raw.item[k] for k in order]
    uv, iv = _vocab(raw.user), _vocab(list(raw.item_genres))
    occupations = _vocab([u[2] for u in raw.user_info.values()])
    genders = _vocab([u[1] for u in raw.user_info.values()])
    age = np.array([raw.user_info.get(u, (None, "", ""))[0] or 0 for u in users], np.float32)
    year = np.array([raw.item_year.get(i) or 0 for i in items], np.float32)
    dense = np.stack([age / 100.0, np.where(year > 0, (year - 1900.0) / 100.0, 0.0)], 1).astype(np.float32)
    info = [raw.user_info.get(u) for u in users]
    sparse = np.stack([
        np.array([uv[u] for u in users]), np.array([iv[i] for i in items]),
        np.array([genders[x[1]] if x else 0 for x in info]),
        np.array([occupations[x[2]] if x else 0 for x in info]),
        np.array([int(np.searchsorted(AGE_EDGES, x[0], side="right")) + 1 if x and x[0] else 0 for x in info]),
    ], 1).astype(np.int32)
    bags = [[GENRES.index(g) + 1 for g in raw.item_genres[i]] for i in items]
    lengths = np.array([len(b) for b in bags], np.int64)
    genre_ids = np.array([g for b in bags for g in b], np.int32)
    specs = [SparseFeatureSpec("user", len(uv) + 1), SparseFeatureSpec("item", len(iv) + 1),
             SparseFeatureSpec("gender", len(genders) + 1), SparseFeatureSpec("occupation", len(occupations) + 1),
             SparseFeatureSpec("age_bucket", len(AGE_EDGES) + 2),
             SparseFeatureSpec("genres", len(GENRES) + 1, multi_hot=True, pooling="mean")]
    extras = {"vertical": "int16", "timestamp": "int64", "example_id": "int64"}
    with PreparedWriter(out_dir, ["age", "year"], specs, extras, overwrite=overwrite) as w:
        w.write((raw.rating[order] >= cfg.threshold).astype(np.float32), dense, sparse,
                jagged={"genres": (lengths, genre_ids, None)}, vertical=vertical[order].astype(np.int16),
                timestamp=raw.timestamp[order], example_id=raw.line[order] - 1)
        w.info = {"source": "movielens", "ratings_file": where, "verticals": names, "threshold": cfg.threshold,
                  "rows": n, "dropped_no_vertical": int(len(raw.item) - n)}
    return Path(out_dir)
