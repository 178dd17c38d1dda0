"""MovieLens readers: the u.data and RecBole layouts give the same stream; bad input names file, line, field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recstack.data.prepare.readers.base import DataError
from recstack.data.prepared_dataset import PreparedDataset
from recstack.exfm.movielens import GENRES, MovieLensConfig, prepare_movielens

# (user, item, rating, timestamp) in file order; not in time order on purpose
RATINGS = [(1, 10, 5, 1000), (2, 11, 3, 900), (1, 12, 4, 1000), (3, 10, 2, 2000), (2, 13, 4, 1500), (1, 15, 5, 1200)]
ITEMS = {10: (["Drama"], "1995"), 11: (["Comedy", "Romance"], "1994"), 12: (["Action", "Thriller"], ""),
         13: (["Comedy", "Drama"], "1990"), 15: (["unknown"], "")}
USERS = {1: (24, "M", "technician"), 2: (53, "F", "other")}  # user 3 has no profile


def write_udata(d: Path, ratings=RATINGS) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ratings))
    lines = []
    for item, (genres, year) in ITEMS.items():
        flags = "|".join("1" if g in genres else "0" for g in GENRES)
        date = f"01-Jan-{year}" if year else ""
        lines.append(f"{item}|Movie {item} ({year})|{date}||http://x|{flags}\n")
    (d / "u.item").write_bytes("".join(lines).encode("latin-1"))
    (d / "u.user").write_text("".join(f"{u}|{a}|{g}|{o}|0000{u}\n" for u, (a, g, o) in USERS.items()))
    return d


def write_recbole(d: Path, item_class=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "ml.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                                + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in RATINGS))
    rows = [f"{i}\tMovie {i}\t{y or 'unkonwn'}\t{' '.join(item_class or g)}\n" for i, (g, y) in ITEMS.items()]
    (d / "ml.item").write_text("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
                               + "".join(rows))
    (d / "ml.user").write_text("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
                               + "".join(f"{u}\t{a}\t{g}\t{o}\t0000{u}\n" for u, (a, g, o) in USERS.items()))
    return d


def _columns(path: Path) -> dict[str, np.ndarray]:
    ds = PreparedDataset(path)
    return {k: np.array(ds.column(k)) for k in ds.arrays}


def test_both_layouts_give_the_same_stream(tmp_path: Path) -> None:
    a = prepare_movielens(MovieLensConfig(path=str(write_udata(tmp_path / "u"))), tmp_path / "pa")
    b = prepare_movielens(MovieLensConfig(path=str(write_recbole(tmp_path / "r"))), tmp_path / "pb")
    ca, cb = _columns(a), _columns(b)
    assert ca.keys() == cb.keys()
    for k in ca:
        np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)
    # time order, ties in file order; the movie with no vertical genre is dropped
    np.testing.assert_array_equal(ca["timestamp"], [900, 1000, 1000, 1500, 2000])
    np.testing.assert_array_equal(ca["example_id"], [1, 0, 2, 4, 3])
    np.testing.assert_array_equal(ca["labels"], [0, 1, 1, 1, 0])  # rating >= 4
    np.testing.assert_array_equal(ca["vertical"], [1, 0, 2, 0, 0])  # comedy, drama, action, drama (first), drama
    info = PreparedDataset(a).info
    assert info["verticals"] == ["drama", "comedy", "action"] and info["dropped_no_vertical"] == 1
    ds = PreparedDataset(a)
    batch = ds.batch(0, 5)
    assert [s.name for s in ds.sparse_features] == ["user", "item", "gender", "occupation", "age_bucket", "genres"]
    user3 = int(np.flatnonzero(ca["example_id"] == 3)[0])
    assert (ca["sparse"][user3, 2:5] == 0).all()  # no profile: missing rows
    assert ca["dense"][1, 0] == pytest.approx(0.24) and ca["dense"][2, 1] == 0.0  # age/100; unknown year
    assert batch.sparse.num_features == 6


def test_other_vertical_and_threshold(tmp_path: Path) -> None:
    d = write_udata(tmp_path / "u")
    out = prepare_movielens(MovieLensConfig(path=str(d), other=True, threshold=5.0), tmp_path / "p")
    c = _columns(out)
    assert len(c["labels"]) == 6 and c["vertical"].max() == 3
    assert PreparedDataset(out).info["verticals"][-1] == "other"
    assert c["labels"].sum() == 2  # two fives


@pytest.mark.parametrize(
    "bad, where, field",
    [((1, 10, "x", 5), "u.data:3", "'rating'"), ((1, 10, 3, "t0"), "u.data:3", "'timestamp'"),
     ((1, 99, 3, 5), "u.data:3", "'item'")],
)
def test_bad_ratings_name_file_line_and_field(tmp_path: Path, bad: tuple, where: str, field: str) -> None:
    d = write_udata(tmp_path / "u", RATINGS[:2] + [bad] + RATINGS[2:])
    with pytest.raises(DataError, match=rf"{where}.*{field}"):
        prepare_movielens(MovieLensConfig(path=str(d)), tmp_path / "p")


def test_bad_layout_errors(tmp_path: Path) -> None:
    d = write_udata(tmp_path / "u")
    with open(d / "u.data", "a") as f:
        f.write("4\t10\t3\n")
    with pytest.raises(DataError, match=r"u.data:7: expected 4 .*got 3"):
        prepare_movielens(MovieLensConfig(path=str(d)), tmp_path / "p")
    r = write_recbole(tmp_path / "r", item_class=["Cartoon"])
    with pytest.raises(DataError, match=r"ml.item:2: column 'class': unknown genre"):
        prepare_movielens(MovieLensConfig(path=str(r)), tmp_path / "q")
    with pytest.raises(ValueError, match=r"movielens.verticals\[0\].genres: unknown genres \['Noir'\]"):
        MovieLensConfig(path=str(r), verticals=[{"name": "x", "genres": ["Noir"]}])
