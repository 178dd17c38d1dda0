"""Schema-driven readers: every format prepares the same arrays, encodings match a plain reference, libFM
field modes, multi-hot pooling through the model's collection, and training end to end from the CLI."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO

from recstack.cli.main import main
from recstack.data.examples import frappe_like, ratings_table, write_libfm, write_ratings
from recstack.data.format import PreparedFormatError, SparseFeatureSpec
from recstack.data.loader import BatchLoader
from recstack.data.prepare.schema import SourceSpec, load_schema, schema_from_dict, split_time
from recstack.data.prepare.schema_prepare import prepare_dataset
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.prepared_writer import PreparedWriter
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizerConfig
from recstack.models.build import table_configs

RATINGS_SCHEMA = REPO / "configs" / "schemas" / "ratings_parquet.toml"
FRAPPE_SCHEMA = REPO / "configs" / "schemas" / "frappe_libfm.toml"
SPLITS = ("train", "valid", "test")
TRAIN = ["--set", "model.embedding_dim=8", "--set", "model.bottom_mlp=[16, 8]", "--set", "model.top_mlp=[32, 1]",
         "--set", "train.batch_size=64", "--set", "train.threads=1", "--set", "train.progress=false",
         "--set", 'optim.sparse="rowwise_adagrad"', "--set", 'train.device="cpu"']


@pytest.fixture(scope="module")
def ratings(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One small rating log written as Parquet, CSV and TSV, each prepared with the repo's schema."""
    d = tmp_path_factory.mktemp("ratings")
    table, prob = ratings_table(6000, seed=3)
    out = {"table": table, "prob": prob, "dir": d}
    for fmt in ("parquet", "csv", "tsv"):
        path = write_ratings(d / f"ratings.{fmt}", table)
        sch = load_schema(RATINGS_SCHEMA)
        sch.source = SourceSpec()  # the format from the file name
        prepare_dataset(sch, [path], d / f"prep_{fmt}", progress=False, chunk_rows=1000)
        out[fmt] = path
    return out


def _arrays(path: Path) -> dict[str, np.ndarray]:
    ds = PreparedDataset(path)
    return {k: np.asarray(v) for k, v in ds.arrays.items()}


def test_parquet_csv_tsv_prepare_identically(ratings: dict) -> None:
    d = ratings["dir"]
    for split in SPLITS:
        ref = _arrays(d / "prep_parquet" / split)
        assert len(ref["labels"]) > 300
        for fmt in ("csv", "tsv"):
            got = _arrays(d / f"prep_{fmt}" / split)
            assert got.keys() == ref.keys()
            for k in ref:
                np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{fmt} {split} {k}")
    meta = json.loads((d / "prep_parquet" / "train" / "meta.json").read_text())
    assert meta["sparse_features"] == [  # reserved: missing (+ out of vocabulary for vocab tables)
        {"name": "user", "num_embeddings": meta["sparse_features"][0]["num_embeddings"], "reserved_rows": 2},
        {"name": "movie", "num_embeddings": meta["info"]["tables"]["movie"], "table": "movie", "reserved_rows": 2},
        {"name": "history", "num_embeddings": meta["info"]["tables"]["movie"], "multi_hot": True,
         "table": "movie", "pooling": "mean", "reserved_rows": 2},
        {"name": "genres", "num_embeddings": 64, "multi_hot": True, "reserved_rows": 1},
        {"name": "device", "num_embeddings": 5, "reserved_rows": 2},
    ]


def _vocab(values: list, min_freq: int) -> dict:
    counts = Counter(str(v) for v in values)
    kept = sorted((v for v, c in counts.items() if c >= min_freq), key=lambda v: (-counts[v], v))
    return {v: i + 2 for i, v in enumerate(kept)}


def test_encodings_match_a_plain_reference(ratings: dict) -> None:
    t = ratings["table"].to_pydict()
    sch = load_schema(RATINGS_SCHEMA)
    ts = np.array([x.timestamp() for x in t["ts"]], np.int64)
    split = np.where(ts >= split_time(sch.split.test_from), 2, np.where(ts >= split_time(sch.split.valid_from), 1, 0))
    train = np.flatnonzero(split == 0)
    users = _vocab([t["user_id"][r] for r in train], 2)
    movies = _vocab([t["movie_id"][r] for r in train] + [m for r in train for m in t["history"][r]], 1)
    ages = np.array([np.nan if a is None else a for a in t["age"]])
    mean, std = np.nanmean(ages[train]), np.nanstd(ages[train])
    verticals: dict[str, int] = {}
    for v in t["device"]:
        verticals.setdefault(v, len(verticals))
    genre_ids: dict[str, set] = {}
    for s, name in enumerate(SPLITS):
        rows = np.flatnonzero(split == s)
        ds = PreparedDataset(ratings["dir"] / "prep_parquet" / name)
        assert len(ds) == len(rows)
        np.testing.assert_array_equal(ds.column("example_id"), np.array(t["event_id"])[rows])
        np.testing.assert_array_equal(ds.column("timestamp"), ts[rows])
        np.testing.assert_array_equal(ds.column("labels"), (np.array(t["rating"])[rows] >= 4).astype(np.float32))
        np.testing.assert_array_equal(ds.column("vertical"), [verticals[t["device"][r]] for r in rows])
        dense = np.asarray(ds.column("dense"))
        want_age = np.where(np.isnan(ages[rows]), 0.0, (ages[rows] - mean) / std)
        np.testing.assert_allclose(dense[:, 0], want_age, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dense[:, 1], np.log1p(np.array(t["num_ratings"])[rows]), rtol=1e-6)
        single = np.asarray(ds.column("sparse"))  # user, movie, device
        assert single.tolist() == [
            [users.get(t["user_id"][r], 1), movies.get(str(t["movie_id"][r]), 1), single[i, 2]]
            for i, r in enumerate(rows)
        ]
        off, vals = np.asarray(ds.column("history.offsets")), np.asarray(ds.column("history.values"))
        for i, r in enumerate(rows):
            want = [movies.get(str(m), 1) for m in t["history"][r]] or [0]  # an empty bag -> "missing"
            assert vals[off[i] : off[i + 1]].tolist() == want
        goff, gvals = np.asarray(ds.column("genres.offsets")), np.asarray(ds.column("genres.values"))
        for i, r in enumerate(rows):
            names = t["genres"][r].split("|") if t["genres"][r] else []
            ids = gvals[goff[i] : goff[i + 1]].tolist()
            if not names:
                assert ids == [0]
                continue
            for g, k in zip(names, ids, strict=True):
                genre_ids.setdefault(g, set()).add(k)
    assert all(len(v) == 1 and 1 <= min(v) < 64 for v in genre_ids.values())  # one stable bucket per genre
    assert len(genre_ids) == 16


def test_multi_hot_pooling_through_the_collection(ratings: dict) -> None:
    ds = PreparedDataset(ratings["dir"] / "prep_parquet" / "train")
    tables = table_configs(ds.table_sizes, 4, ds.table_names)
    assert [t.name for t in tables] == ["user", "movie", "genres", "device"]
    assert tables[1].features == (1, 2)  # movie and history share one table
    coll = FusedEmbeddingBagCollection(tables, SparseOptimizerConfig("sgd", 0.1), seed=0).eval()
    rows = np.arange(40, 104)
    for batch in (ds.batch(40, 104), ds.gather(rows)):
        with torch.no_grad():
            pooled = coll(batch.sparse)  # [B, F, D]
        weights = {t.name: coll.table_weight(t.name) for t in tables}
        single = np.asarray(ds.column("sparse"))[rows]
        for b, r in enumerate(rows):
            torch.testing.assert_close(pooled[b, 0], weights["user"][single[b, 0]])
            torch.testing.assert_close(pooled[b, 1], weights["movie"][single[b, 1]])
            for f, name, table, mean in ((2, "history", "movie", True), (3, "genres", "genres", False)):
                off = ds.column(f"{name}.offsets")
                ids = torch.as_tensor(np.array(ds.column(f"{name}.values")[off[r] : off[r + 1]]), dtype=torch.long)
                rows_ = weights[table][ids]
                torch.testing.assert_close(pooled[b, f], rows_.mean(0) if mean else rows_.sum(0))


def test_single_valued_data_keeps_the_old_layout(tmp_path: Path) -> None:
    with PreparedWriter(tmp_path / "d", ["x"], [SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 7)]) as w:
        w.write(np.array([0, 1], np.float32), np.ones((2, 1)), np.array([[1, 2], [3, 4]]))
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["sparse_features"] == [{"name": "a", "num_embeddings": 5}, {"name": "b", "num_embeddings": 7}]
    assert set(meta["arrays"]) == {"labels", "dense", "sparse"} and meta["arrays"]["sparse"]["shape"] == [2, 2]
    s = PreparedDataset(tmp_path / "d").batch(0, 2).sparse
    assert s.ids.tolist() == [1, 3, 2, 4] and s.offsets.tolist() == [0, 1, 2, 3, 4] and s.weights is None


def test_ids_outside_their_table_are_an_error_naming_file_row_and_feature(tmp_path: Path) -> None:
    """A damaged file's id beyond its table would look up a row of the next table in a fused collection (or fail
    on a GPU with a device assert): reading it is an error naming the file, the row and the feature."""
    specs = [SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 7), SparseFeatureSpec("m", 4, multi_hot=True)]
    with PreparedWriter(tmp_path / "d", ["x"], specs) as w:
        w.write(np.zeros(4, np.float32), np.ones((4, 1)), np.array([[1, 2], [3, 4], [0, 6], [4, 0]]),
                jagged={"m": (np.array([2, 0, 1, 2]), np.array([0, 3, 1, 2, 3]), None)})
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())["arrays"]
    for array, index, value, rows, message in [
        ("sparse", (2, 1), 7, (0, 4), "row 2, sparse feature 'b': id 7 is outside its table of 7 rows"),
        ("sparse", (3, 0), -1, (3, 4), "row 3, sparse feature 'a': id -1 is outside its table of 5 rows"),
        ("m.values", 3, 4, (1, 4), "row 3, sparse feature 'm': id 4 is outside its table of 4 rows"),
    ]:
        spec = meta[array]
        data = np.memmap(tmp_path / "d" / spec["file"], dtype=spec["dtype"], mode="r+", shape=tuple(spec["shape"]))
        good = data[index].copy()
        data[index] = value
        data.flush()
        ds = PreparedDataset(tmp_path / "d")
        with pytest.raises(PreparedFormatError, match=re.escape(f"{tmp_path / 'd' / spec['file']}: {message}")):
            ds.batch(*rows)
        with pytest.raises(PreparedFormatError, match=re.escape(message)):
            ds.gather(np.arange(rows[0], rows[1]))
        ds.batch(0, rows[0])  # the rows before it read as they are
        data[index] = good
        data.flush()
    assert PreparedDataset(tmp_path / "d").batch(0, 4).sparse.ids.numel() == 13


def test_loader_caps_ids_of_multi_hot_features(ratings: dict) -> None:
    ds = PreparedDataset(ratings["dir"] / "prep_parquet" / "train")
    caps = [7, 5, 5, 3, 2]
    plain = BatchLoader(ds, 32, prefetch=0)
    capped = BatchLoader(ds, 32, table_caps=caps, prefetch=0)
    for a, b, _ in zip(plain.iterate_epoch(), capped.iterate_epoch(), range(20), strict=False):
        assert torch.equal(a.sparse.offsets, b.sparse.offsets)
        feature = torch.repeat_interleave(torch.arange(5), a.sparse.lengths.view(5, -1).sum(1))
        assert torch.equal(b.sparse.ids, a.sparse.ids % torch.tensor(caps)[feature])


def test_libfm_positional_fields(tmp_path: Path) -> None:
    labels, idx, _ = frappe_like(3000, seed=4)
    path = write_libfm(tmp_path / "f.libfm", labels, idx)
    prepare_dataset(load_schema(FRAPPE_SCHEMA), [path], tmp_path / "p", progress=False, chunk_rows=700)
    ds = PreparedDataset(tmp_path / "p")
    assert ds.dense_features == [] and len(ds.sparse_features) == 10
    np.testing.assert_array_equal(ds.column("labels"), (labels > 0).astype(np.float32))
    ids = np.asarray(ds.column("sparse"))
    for f in range(10):  # one row per distinct global index, most frequent first, from row 2
        counts = Counter(idx[:, f].tolist())
        order = sorted(counts, key=lambda v: (-counts[v], str(v)))
        assert ids[:, f].tolist() == [order.index(v) + 2 for v in idx[:, f]]


def test_libfm_field_ranges_ffm_and_weights(tmp_path: Path) -> None:
    rows = [(1, [(0, 3, 1.0), (0, 7, 0.5), (1, 12, 2.0)]), (-1, [(1, 10, 1.0)]), (1, [(0, 1, 1.0), (1, 14, 1.0)])]
    (tmp_path / "a.libfm").write_text("".join(f"{y} " + " ".join(f"{i}:{v:g}" for _, i, v in t) + "\n"
                                              for y, t in rows))
    (tmp_path / "a.ffm").write_text("".join(f"{y} " + " ".join(f"{f}:{i}:{v:g}" for f, i, v in t) + "\n"
                                            for y, t in rows))
    ranges = schema_from_dict({
        "source": {"field_ranges": {"u": [0, 10], "i": [10, 15]}}, "label": {"threshold": 0.0},
        "sparse": [{"name": n, "multi_hot": True, "encoding": "identity", "size": s, "weight_column": f"{n}#value"}
                   for n, s in (("u", 10), ("i", 5))],
    })
    ffm = schema_from_dict({
        "source": {"fields": ["u", "i"]}, "label": {"threshold": 0.0},
        "sparse": [{"name": "u", "multi_hot": True, "encoding": "identity", "size": 10},
                   {"name": "i", "multi_hot": True, "encoding": "hash", "hash_size": 1000}],
    })
    prepare_dataset(ranges, [tmp_path / "a.libfm"], tmp_path / "r", progress=False)
    prepare_dataset(ffm, [tmp_path / "a.ffm"], tmp_path / "f", progress=False)
    r, f = PreparedDataset(tmp_path / "r"), PreparedDataset(tmp_path / "f")
    assert r.column("labels").tolist() == [1, 0, 1]
    assert np.asarray(r.column("u.values")).tolist() == [4, 8, 0, 2]  # identity: row = index + 1, empty -> 0
    assert np.asarray(r.column("u.offsets")).tolist() == [0, 2, 3, 4]
    assert np.asarray(r.column("i.values")).tolist() == [3, 1, 5]  # index - 10 + 1
    assert np.asarray(r.column("u.weights")).tolist() == [1.0, 0.5, 1.0, 1.0]
    assert np.asarray(f.column("u.values")).tolist() == [4, 8, 0, 2]
    ib = np.asarray(f.column("i.values"))
    assert len(ib) == 3 and ib[0] not in (ib[1], ib[2]) and ib[1] != ib[2] and min(ib) >= 1
    batch = r.batch(0, 3)
    assert batch.sparse.weights.tolist() == [1.0, 0.5, 1.0, 1.0, 2.0, 1.0, 1.0]
    assert batch.sparse.lengths.tolist() == [2, 1, 1, 1, 1, 1]


def test_gzip_inputs_parquet_directories_and_stats_from(ratings: dict, tmp_path: Path) -> None:
    table = ratings["table"]
    gz = tmp_path / "r.csv.gz"
    gz.write_bytes(gzip.compress(ratings["csv"].read_bytes()))
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, lo in enumerate(range(0, table.num_rows, 2500)):
        pq.write_table(table.slice(lo, 2500), parts / f"part-{i:02d}.parquet")
    sch = load_schema(RATINGS_SCHEMA)
    sch.source = SourceSpec()
    prepare_dataset(sch, [gz], tmp_path / "gz", progress=False)
    prepare_dataset(sch, [parts], tmp_path / "parts_out", progress=False)
    for out in ("gz", "parts_out"):
        for split in SPLITS:
            ref = _arrays(ratings["dir"] / "prep_parquet" / split)
            got = _arrays(tmp_path / out / split)
            assert all(np.array_equal(got[k], ref[k]) for k in ref), (out, split)
    # later data prepared with the training vocabularies: same tables, unseen users -> out of vocabulary
    later, _ = ratings_table(500, seed=9, users=2000)
    path = write_ratings(tmp_path / "later.parquet", later)
    sch.split.method = "none"
    prepare_dataset(sch, [path], tmp_path / "later", stats_from=ratings["dir"] / "prep_parquet" / "train",
                    progress=False)
    a, b = PreparedDataset(ratings["dir"] / "prep_parquet" / "train"), PreparedDataset(tmp_path / "later")
    assert a.table_sizes == b.table_sizes
    users = np.asarray(b.column("sparse"))[:, 0]
    unseen = np.array([int(u[1:]) >= 500 for u in later.column("user_id").to_pylist()])
    assert (users[unseen] == 1).all() and (users[~unseen] != 1).mean() > 0.5


def test_fraction_split_is_a_stable_partition(ratings: dict, tmp_path: Path) -> None:
    sch = load_schema(RATINGS_SCHEMA)
    sch.split.method, sch.split.valid, sch.split.test = "fraction", 0.2, 0.1
    rows = {}
    for run in ("a", "b"):
        rep = prepare_dataset(sch, [ratings["parquet"]], tmp_path / run, progress=False, chunk_rows=999)
        rows[run] = {s: np.asarray(PreparedDataset(p).column("example_id")) for s, p in rep.outputs.items()}
    assert all(np.array_equal(rows["a"][s], rows["b"][s]) for s in SPLITS)
    n = ratings["table"].num_rows
    assert sorted(np.concatenate(list(rows["a"].values())).tolist()) == ratings["table"].column("event_id").to_pylist()
    assert abs(len(rows["a"]["valid"]) / n - 0.2) < 0.03 and abs(len(rows["a"]["test"]) / n - 0.1) < 0.03


def _train(data: Path, out: Path, steps: int) -> dict:
    assert main(["train", "--output-dir", str(out), "--set", f'data.train="{data / "train"}"',
                 "--set", f'data.eval="{data / "valid"}"', "--set", f"train.max_steps={steps}", *TRAIN]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("fmt", ["parquet", "csv", "tsv", "libfm"])
def test_prepare_and_train_from_the_cli(fmt: str, ratings: dict, tmp_path: Path) -> None:
    if fmt == "libfm":
        labels, idx, _ = frappe_like(9000, seed=5)
        inputs = [str(write_libfm(tmp_path / "train.libfm", labels[:7000], idx[:7000])),
                  "--valid", str(write_libfm(tmp_path / "valid.libfm", labels[7000:], idx[7000:]))]
        schema = FRAPPE_SCHEMA
    else:
        inputs = [str(ratings[fmt])]
        schema = tmp_path / "s.toml"  # the repo schema, reading the format from the file name
        schema.write_text(RATINGS_SCHEMA.read_text().replace('format = "parquet"', ""))
    assert main(["data", "prepare", "--schema", str(schema), *inputs, "--out", str(tmp_path / "data"),
                 "--no-progress"]) == 0
    summary = _train(tmp_path / "data", tmp_path / "run", 150)
    assert summary["steps"] == 150
    # chance is 0.5; both generators reach ~0.87-0.9 with their true probabilities
    assert summary["auc"] > 0.62, summary
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(tmp_path / "data" / "valid")]) == 0


def test_text_multi_hot_with_text_weights(tmp_path: Path) -> None:
    (tmp_path / "w.csv").write_text("label,tags,w\n1,a|b,0.5|2\n0,,\n1,b,3\n")
    sch = schema_from_dict({"sparse": [{"name": "tags", "multi_hot": True, "weight_column": "w",
                                        "pooling": "mean"}]})
    prepare_dataset(sch, [tmp_path / "w.csv"], tmp_path / "p", progress=False)
    ds = PreparedDataset(tmp_path / "p")
    assert np.asarray(ds.column("tags.values")).tolist() == [3, 2, 0, 2]  # vocab by frequency: b=2, a=3
    assert np.asarray(ds.column("tags.weights")).tolist() == [0.5, 2.0, 1.0, 3.0]
    assert ds.batch(0, 3).sparse.weights.tolist() == [0.25, 1.0, 1.0, 3.0]  # mean pooling: weight / bag size


def test_timestamps_of_any_unit_and_iso_text_become_whole_seconds(tmp_path: Path) -> None:
    import datetime as dt

    import pyarrow as pa

    from recstack.data.prepare.columns import to_seconds

    # pandas writes datetime64[ns]: sub-second precision is rounded down, whatever the unit or zone
    base = dt.datetime(2024, 1, 1, 10, 0, 0)
    times = [base + dt.timedelta(microseconds=250000), base + dt.timedelta(days=1),
             base + dt.timedelta(days=4, microseconds=999000), base - dt.timedelta(days=20000, microseconds=1000)]
    want = [1704103200, 1704189600, 1704448800, 1704103200 - 20000 * 86400 - 1]  # before 1970: still down
    for unit in ("ms", "us", "ns"):
        for tz in (None, "UTC", "Europe/Paris"):  # zoned values are instants: the zone changes nothing
            secs, bad = to_seconds(pa.array(times, pa.timestamp("us")).cast(pa.timestamp(unit, tz=tz)))
            assert secs.tolist() == want and not bad.any(), (unit, tz)
    secs, _ = to_seconds(pa.array([dt.date(2024, 1, 2)], pa.date64()))
    assert secs.tolist() == [1704153600]
    # ISO 8601 text: Z, offsets, fractional seconds, no zone (UTC); decimal seconds like float seconds
    text = ["2024-01-01T10:00:00Z", "2024-01-01T12:00:00+02:00", "2024-01-01 10:00:00.75", "2024-01-01T10:00",
            "1704103200.5", "1704103200", "2024-01-01T10:00:00.123456789-00:30", "1969-12-31T23:59:59.5"]
    secs, bad = to_seconds(pa.array(text))
    assert not bad.any()
    assert secs.tolist() == [1704103200] * 6 + [1704105000, -1]
    for one in text:  # each alone (the vectorised casts) and mixed (the value-by-value path) agree
        assert to_seconds(pa.array([one]))[0].tolist() == to_seconds(pa.array([one, "x", None]))[0][:1].tolist()
    assert to_seconds(pa.array([1.5, -0.5]))[0].tolist() == [1, -1]
    assert to_seconds(pa.array(["yesterday", "1e300", "nan", None]))[1].tolist() == [True] * 4
    # end to end: a Parquet file with nanosecond timestamps, split by time
    table = pa.table({"click": [1, 0, 1, 0], "item": ["a", "b", "a", "c"],
                      "ts": pa.array(times, pa.timestamp("ns"))})
    pq.write_table(table, tmp_path / "ts.parquet")
    sch = schema_from_dict({"label": {"column": "click"}, "sparse": [{"name": "item"}],
                            "columns": {"timestamp": "ts"},
                            "split": {"method": "time", "valid_from": "2024-01-04T00:00:00Z"}})
    rep = prepare_dataset(sch, [tmp_path / "ts.parquet"], tmp_path / "out", progress=False)
    assert rep.rows == {"train": 3, "valid": 1}
    train = np.asarray(PreparedDataset(tmp_path / "out" / "train").column("timestamp")).tolist()
    assert train == [want[0], want[1], want[3]]


def test_csv_byte_order_mark_is_not_part_of_the_first_column(tmp_path: Path) -> None:
    sch = schema_from_dict({"label": {"column": "click"}, "dense": [{"name": "price"}], "sparse": [{"name": "c"}]})
    (tmp_path / "bom.csv").write_text("\ufeffclick,price,c\n1,2.5,a\n0,3.5,b\n", encoding="utf-8")
    (tmp_path / "bom.csv.gz").write_bytes(gzip.compress((tmp_path / "bom.csv").read_bytes()))
    (tmp_path / "plain.csv").write_text("click,price,c\n1,2.5,a\n0,3.5,b\n")
    for name in ("bom.csv", "bom.csv.gz", "plain.csv"):
        prepare_dataset(sch, [tmp_path / name], tmp_path / f"{name}_out", progress=False)
        assert _arrays(tmp_path / f"{name}_out")["labels"].tolist() == [1, 0]
    ref = _arrays(tmp_path / "plain.csv_out")
    for name in ("bom.csv", "bom.csv.gz"):
        got = _arrays(tmp_path / f"{name}_out")
        assert all(np.array_equal(got[k], ref[k]) for k in ref)
    # without a header the first value keeps no mark either
    headless = schema_from_dict({"source": {"header": False, "columns": ["click", "c"]},
                                 "label": {"column": "click"}, "sparse": [{"name": "c", "encoding": "identity",
                                                                           "size": 10}]})
    (tmp_path / "nohdr.csv").write_text("\ufeff1,7\n0,3\n", encoding="utf-8")
    prepare_dataset(headless, [tmp_path / "nohdr.csv"], tmp_path / "nohdr", progress=False)
    assert _arrays(tmp_path / "nohdr")["labels"].tolist() == [1, 0]
    from recstack.data.prepare.inspect import inspect_file

    assert [c.name for c in inspect_file([tmp_path / "bom.csv"]).columns] == ["click", "price", "c"]


def test_overwrite_with_a_split_removes_an_earlier_unsplit_output(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("y,c\n" + "".join(f"{i % 2},v{i}\n" for i in range(50)))
    plain = {"label": {"column": "y"}, "sparse": [{"name": "c"}]}
    prepare_dataset(schema_from_dict(plain), [path], tmp_path / "out", progress=False)
    (tmp_path / "out" / "notes.txt").write_text("mine")  # not a prepared file: stays
    split = {**plain, "split": {"method": "fraction", "valid": 0.2}}
    rep = prepare_dataset(schema_from_dict(split), [path], tmp_path / "out", progress=False, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["notes.txt", "train", "valid"]
    assert sum(rep.rows.values()) == 50
    # and back: an unsplit output replaces the split one
    prepare_dataset(schema_from_dict(plain), [path], tmp_path / "out", progress=False, overwrite=True)
    assert PreparedDataset(tmp_path / "out").num_rows == 50 and not (tmp_path / "out" / "train").exists()


def test_null_and_empty_values_make_empty_bags() -> None:
    """A null value (an empty, unquoted CSV field) is a missing value like an empty string: an empty bag, in
    single- and multi-valued columns (a null used to break the validity mask with an IndexError)."""
    import pyarrow as pa

    from recstack.data.prepare.columns import to_bag

    bag = to_bag(pa.array(["a", None, "", "b"]), False, "|")
    assert bag.lengths.tolist() == [1, 0, 0, 1] and bag.values.to_pylist() == ["a", "b"]
    bag = to_bag(pa.array(["a|", None, "|c", "b"]), True, "|")
    assert bag.lengths.tolist() == [1, 0, 1, 1] and bag.values.to_pylist() == ["a", "c", "b"]
