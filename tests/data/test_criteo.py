"""Criteo raw TSV reader and prepare_criteo, against real sample files and a straightforward parse."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from recstack.data.prepare.criteo import (
    DENSE_NAMES,
    KAGGLE_CARDINALITIES,
    SPARSE_NAMES,
    TERABYTE_CARDINALITIES,
    CriteoFormatError,
    CriteoReader,
    _parse_block,
    _parse_fields,
    _RowError,
)
from recstack.data.prepare.criteo_prepare import prepare_criteo, sort_day_files
from recstack.data.prepare.criteo_vocab import VocabCounter, apply_vocabularies
from recstack.data.prepared_dataset import PreparedDataset

DATA = SHARED_DATA
SAMPLE = DATA / "criteo_kaggle_sample.tsv"  # 1,999 rows, 418 clicks, every line 40 fields
RAW1000 = DATA / "criteo_kaggle_raw1000.tsv"  # 1,000 rows, 498 stripped, no final newline


@pytest.fixture(scope="module")
def real() -> Path:
    if not SAMPLE.is_file() or not RAW1000.is_file():
        pytest.skip(f"real Criteo samples not found in {DATA} (expected beside the repository as shared/data)")
    return DATA


def naive_parse(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Line by line with str.split: labels [n], raw dense int [n, 13], transformed dense, raw cats [n, 26]."""
    labels, dense, cats = [], [], []
    for line in path.read_text().splitlines():
        f = line.split("\t")
        f += [""] * (40 - len(f))
        labels.append(int(f[0]))
        dense.append([int(v) if v else 0 for v in f[1:14]])
        cats.append([int(v, 16) if v else 0 for v in f[14:40]])
    d = np.array(dense, np.int64)
    logd = np.array([[math.log1p(max(v, 0)) for v in row] for row in dense], np.float32)
    return np.array(labels, np.float32), d, logd, np.array(cats, np.int64)


def read_all(path: Path, **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunks = list(CriteoReader(path, **kw))
    return tuple(np.concatenate([getattr(c, k) for c in chunks]) for k in ("labels", "dense", "sparse"))


def vocab_ids(raw: np.ndarray, min_freq: int = 1) -> tuple[np.ndarray, list[int]]:
    """Expected ids for the documented rule: kept values ranked by raw value from 1, everything else 0."""
    out = np.zeros(raw.shape, np.int64)
    sizes = []
    for f in range(raw.shape[1]):
        values, counts = np.unique(raw[raw[:, f] != 0, f], return_counts=True)
        kept = values[counts >= min_freq].tolist()
        rank = {v: i + 1 for i, v in enumerate(kept)}
        out[:, f] = [rank.get(v, 0) if v else 0 for v in raw[:, f].tolist()]
        sizes.append(len(kept) + 1)
    return out, sizes


def rand_line(rng: np.random.Generator, fields: int = 40) -> str:
    """A valid synthetic row (not real data): some empty, negative and multi-digit values."""
    f = [str(int(rng.integers(0, 2)))]
    for _ in range(13):
        r = rng.random()
        f.append("" if r < 0.15 else str(int(rng.integers(-3, 0))) if r < 0.2 else str(int(rng.integers(0, 10**6))))
    for _ in range(26):
        f.append("" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}")
    return "\t".join(f[:fields])


def write_lines(path: Path, lines: list[str], final_newline: bool = True) -> Path:
    path.write_text("\n".join(lines) + ("\n" if final_newline else ""))
    return path


# ------------------------------------------------------------------------------------------- real files
def test_constants_match_shared_json(real: Path) -> None:
    import json

    ref = json.loads((real / "criteo_cardinalities.json").read_text())
    assert KAGGLE_CARDINALITIES == ref["criteo_kaggle"]
    assert TERABYTE_CARDINALITIES == ref["criteo_terabyte"]
    assert DENSE_NAMES == [f"I{i}" for i in range(1, 14)] and SPARSE_NAMES == [f"C{i}" for i in range(1, 27)]


@pytest.mark.parametrize("name, rows", [("criteo_kaggle_sample.tsv", 1999), ("criteo_kaggle_raw1000.tsv", 1000)])
def test_real_file_reader_matches_naive_parse(real: Path, name: str, rows: int) -> None:
    labels, raw_dense, log_dense, cats = naive_parse(real / name)
    assert len(labels) == rows
    # Tiny chunks and reads force rows to straddle chunk and read boundaries (97-byte reads: every line
    # spans several reads).
    for block_bytes in (5000, 97):
        got_l, got_d, got_c = read_all(real / name, chunk_rows=97, block_bytes=block_bytes, transform=False)
        np.testing.assert_array_equal(got_l, labels)
        np.testing.assert_array_equal(got_d, raw_dense)
        np.testing.assert_array_equal(got_c, cats)
    _, got_logd, _ = read_all(real / name)
    np.testing.assert_array_equal(got_logd, log_dense)  # both: float64 log1p rounded once to float32


def test_real_files_prepare_and_read_back(real: Path, tmp_path: Path) -> None:
    for name, rows in [("criteo_kaggle_sample.tsv", 1999), ("criteo_kaggle_raw1000.tsv", 1000)]:
        labels, _, log_dense, cats = naive_parse(real / name)
        rep = prepare_criteo([real / name], tmp_path / name, progress=False)
        ds = PreparedDataset(tmp_path / name)
        assert rep.rows == len(ds) == rows and rep.skipped == 0
        assert ds.dense_features == DENSE_NAMES and [s.name for s in ds.sparse_features] == SPARSE_NAMES
        np.testing.assert_array_equal(ds.column("labels"), labels)
        np.testing.assert_array_equal(ds.column("dense"), log_dense)
        want_ids, want_sizes = vocab_ids(cats)
        np.testing.assert_array_equal(ds.column("sparse"), want_ids)
        assert ds.table_sizes == rep.table_sizes == want_sizes
        assert ds.info["inputs"] == [str(real / name)] and ds.info["skipped_rows"] == 0
        vocab = np.load(tmp_path / name / "vocab.npz")
        assert [len(vocab[c]) + 1 for c in SPARSE_NAMES] == want_sizes
    assert PreparedDataset(tmp_path / "criteo_kaggle_sample.tsv").column("labels").sum() == 418


def test_specific_rows_including_stripped(real: Path) -> None:
    """A few rows checked field by field against str.split, including the first stripped one."""
    lines = (real / "criteo_kaggle_raw1000.tsv").read_text().splitlines()
    stripped = next(i for i, s in enumerate(lines) if len(s.split("\t")) < 40)
    labels, dense, cats = read_all(real / "criteo_kaggle_raw1000.tsv", transform=False)
    for i in [0, stripped, len(lines) - 1]:
        f = lines[i].split("\t")
        assert labels[i] == float(f[0])
        assert dense[i].tolist() == [int(v) if v else 0 for v in f[1:14]]
        want = [int(v, 16) if v else 0 for v in f[14:]] + [0] * (40 - len(f))
        assert cats[i].tolist() == want
    assert len(lines[stripped].split("\t")) < 40 and cats[stripped, -1] == 0


def test_gzip_input_gives_identical_output(real: Path, tmp_path: Path) -> None:
    gz = tmp_path / "no_gz_suffix.tsv"  # detected by magic bytes, not by name
    gz.write_bytes(gzip.compress(RAW1000.read_bytes()))
    a = prepare_criteo([RAW1000], tmp_path / "plain", progress=False)
    b = prepare_criteo([gz], tmp_path / "gz", progress=False)
    assert a.rows == b.rows == 1000
    for col in ("labels.bin", "dense.bin", "sparse.bin", "vocab.npz"):
        assert (tmp_path / "plain" / col).read_bytes() == (tmp_path / "gz" / col).read_bytes()


def test_hashing_vs_vocab_table_sizes(real: Path, tmp_path: Path) -> None:
    _, _, _, cats = naive_parse(SAMPLE)
    h = prepare_criteo([SAMPLE], tmp_path / "h", max_ind_range=1000, progress=False)
    ds = PreparedDataset(tmp_path / "h")
    assert h.table_sizes == ds.table_sizes == [1000] * 26
    np.testing.assert_array_equal(ds.column("sparse"), cats % 1000)
    assert ds.info["categorical"]["mode"] == "hash"
    v = prepare_criteo([SAMPLE], tmp_path / "v", vocab_min_freq=3, chunk_rows=150, progress=False)
    want_ids, want_sizes = vocab_ids(cats, min_freq=3)
    assert v.table_sizes == PreparedDataset(tmp_path / "v").table_sizes == want_sizes
    np.testing.assert_array_equal(PreparedDataset(tmp_path / "v").column("sparse"), want_ids)
    assert want_sizes != vocab_ids(cats)[1]  # min_freq really dropped values
    with pytest.raises(ValueError, match="not both"):
        prepare_criteo([SAMPLE], tmp_path / "x", max_ind_range=10, vocab_min_freq=1, progress=False)


def test_multiple_inputs_concatenate_in_order(real: Path, tmp_path: Path) -> None:
    rep = prepare_criteo([RAW1000, SAMPLE], tmp_path / "both", max_ind_range=997, chunk_rows=300, progress=False)
    assert rep.rows == 2999 and rep.rows_per_input == [1000, 1999]
    ds = PreparedDataset(tmp_path / "both")
    parts = [naive_parse(p) for p in (RAW1000, SAMPLE)]
    np.testing.assert_array_equal(ds.column("labels"), np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(ds.column("sparse"), np.concatenate([p[3] for p in parts]) % 997)
    assert ds.info["inputs"] == [str(RAW1000), str(SAMPLE)]
    with pytest.raises(FileExistsError):
        prepare_criteo([SAMPLE], tmp_path / "both", progress=False)
    again = prepare_criteo([SAMPLE], tmp_path / "both", max_ind_range=5, overwrite=True, progress=False)
    assert again.rows == len(PreparedDataset(tmp_path / "both")) == 1999



def test_negative_sub_sampling_keeps_every_positive_the_same_rows_for_any_chunking(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    files = [write_lines(tmp_path / f"day_{i}.tsv", [rand_line(rng) for _ in range(n)])
             for i, n in enumerate((1500, 900))]
    parsed = [naive_parse(f) for f in files]
    rate, seed = 0.75, 3
    # the documented rule: row j of input i is kept when positive or when draw j of rng (seed, i) >= rate
    keep = np.concatenate([(p[0] > 0) | (np.random.default_rng([seed, i]).random(len(p[0])) >= rate)
                           for i, p in enumerate(parsed)])
    labels = np.concatenate([p[0] for p in parsed])
    cats = np.concatenate([p[3] for p in parsed])
    runs = {}
    for name, chunk in (("small", 128), ("large", 100_000)):
        rep = prepare_criteo(files, tmp_path / name, max_ind_range=997, chunk_rows=chunk, sub_sample_rate=rate,
                             sub_sample_seed=seed, progress=False)
        runs[name] = PreparedDataset(tmp_path / name)
        assert rep.rows == keep.sum() and rep.dropped_negatives == (~keep).sum() and rep.rows_per_input == [1500, 900]
    ds = runs["small"]
    np.testing.assert_array_equal(ds.column("labels"), labels[keep])
    np.testing.assert_array_equal(ds.column("sparse"), cats[keep] % 997)
    np.testing.assert_array_equal(runs["large"].column("dense"), ds.column("dense"))
    assert (ds.column("labels") > 0).sum() == (labels > 0).sum()  # every positive stays
    negatives = (labels == 0).sum()
    kept_share = (np.asarray(ds.column("labels")) == 0).sum() / negatives
    assert abs(kept_share - (1 - rate)) < 5 * math.sqrt(rate * (1 - rate) / negatives)
    assert ds.info["negative_sub_sampling"] == {"rate": rate, "seed": seed, "dropped_negatives": int((~keep).sum())}
    other = prepare_criteo(files, tmp_path / "seed4", max_ind_range=997, sub_sample_rate=rate, sub_sample_seed=4,
                           progress=False)
    assert other.rows != rep.rows or not np.array_equal(PreparedDataset(tmp_path / "seed4").column("dense"),
                                                        ds.column("dense"))
    # a vocabulary counts the kept rows only
    v = prepare_criteo(files, tmp_path / "vocab", vocab_min_freq=2, sub_sample_rate=rate, sub_sample_seed=seed,
                       chunk_rows=300, progress=False)
    want_ids, want_sizes = vocab_ids(cats[keep], min_freq=2)
    assert v.table_sizes == want_sizes
    np.testing.assert_array_equal(PreparedDataset(tmp_path / "vocab").column("sparse"), want_ids)
    plain = prepare_criteo(files, tmp_path / "rate0", max_ind_range=997, sub_sample_rate=0.0, progress=False)
    assert plain.rows == 2400 and plain.dropped_negatives == 0
    with pytest.raises(ValueError, match=r"sub_sample_rate must be in \[0, 1\)"):
        prepare_criteo(files, tmp_path / "bad", sub_sample_rate=1.0, progress=False)


def test_sub_sample_rate_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from recstack.cli.main import main

    rng = np.random.default_rng(6)
    raw = write_lines(tmp_path / "day_0.tsv", [rand_line(rng) for _ in range(400)])
    assert main(["data", "prepare", str(raw), "--out", str(tmp_path / "p"), "--max-ind-range", "97",
                 "--sub-sample-rate", "0.5", "--sub-sample-seed", "1"]) in (0, None)
    dropped = PreparedDataset(tmp_path / "p").info["negative_sub_sampling"]["dropped_negatives"]
    assert dropped > 0 and f"dropped {dropped} negative rows" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="applies to Criteo raw files"):
        main(["data", "prepare", str(raw), "--out", str(tmp_path / "q"), "--schema", "x.toml",
              "--sub-sample-rate", "0.5"])

# ------------------------------------------------------------------------------------------- bad input
GOOD = rand_line(np.random.default_rng(1))


def _with_field(i: int, value: str) -> str:
    f = GOOD.split("\t")
    f[i] = value
    return "\t".join(f)


BAD_CASES = {
    "too many fields": (GOOD + "\tabcdef01", None, "41 TAB-separated fields"),
    "too few fields": ("\t".join(GOOD.split("\t")[:13]), None, "13 TAB-separated fields"),
    "blank line": ("", None, "1 TAB-separated fields"),
    "non-hex category": (_with_field(16, "12zz5678"), "C3", "hex digits"),
    "9 hex digits": (_with_field(18, "123456789"), "C5", "hex digits"),
    "non-integer dense": (_with_field(5, "1.5"), "I5", "not an integer"),
    "lone minus": (_with_field(2, "-"), "I2", "not an integer"),
    "19-digit dense": (_with_field(13, "1" * 19), "I13", "more than 18 digits"),
    "label 2": (_with_field(0, "2"), "label", "0 or 1"),
    "empty label": (_with_field(0, ""), "label", "0 or 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_row_raises_with_file_line_field(tmp_path: Path, case: str) -> None:
    bad, field, reason = BAD_CASES[case]
    rng = np.random.default_rng(2)
    lines = [rand_line(rng) for _ in range(1500)]
    lines[1233] = bad  # line 1234, past several parse steps and (with block_bytes) several reads
    path = write_lines(tmp_path / "bad.tsv", lines)
    with pytest.raises(CriteoFormatError) as ei:
        read_all(path, block_bytes=20000)
    e = ei.value
    assert (e.file, e.line, e.field) == (str(path), 1234, field)
    assert f"{path}:1234" in str(e) and reason in str(e)
    if field is not None:
        assert f"field {field}" in str(e)
    with pytest.raises(CriteoFormatError, match=f"{path}:1234"):
        prepare_criteo([path], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_empty_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "empty.tsv"
    path.write_bytes(b"")
    with pytest.raises(CriteoFormatError, match="empty file") as ei:
        read_all(path)
    assert ei.value.file == str(path) and str(path) in str(ei.value)
    gz = tmp_path / "empty.gz"
    gz.write_bytes(gzip.compress(b""))
    with pytest.raises(CriteoFormatError, match="empty file"):
        prepare_criteo([gz], tmp_path / "out", progress=False)


def test_not_a_tsv_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "binary.dat"
    path.write_bytes(b"0\t" + b"7" * (3 << 20))  # no newline for megabytes
    with pytest.raises(CriteoFormatError, match=f"{path}:1: line longer than"):
        read_all(path)


def test_truncated_gzip_raises(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    blob = gzip.compress(("\n".join(rand_line(rng) for _ in range(300)) + "\n").encode())
    path = tmp_path / "cut.gz"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CriteoFormatError, match="gzip"):
        read_all(path)


def test_skip_bad_rows_counts_and_locates(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    lines = [rand_line(rng) for _ in range(1000)]
    bad_at = {10: "label 2", 500: "non-hex category", 999: "too many fields"}  # 0-based
    for i, case in bad_at.items():
        lines[i] = BAD_CASES[case][0]
    path = write_lines(tmp_path / "some_bad.tsv", lines, final_newline=False)
    reader = CriteoReader(path, skip_bad_rows=True, chunk_rows=128)
    got = np.concatenate([c.sparse for c in reader])
    want = naive_sparse([s for i, s in enumerate(lines) if i not in bad_at])
    np.testing.assert_array_equal(got, want)
    assert reader.skipped == 3 and reader.rows == 997 and reader.lines == 1000
    assert [(b.line, b.field) for b in reader.bad_rows] == [(11, "label"), (501, "C3"), (1000, None)]
    rep = prepare_criteo([path], tmp_path / "out", skip_bad_rows=True, max_ind_range=100, progress=False)
    assert rep.rows == 997 and rep.skipped == 3 and [b.line for b in rep.bad_rows] == [11, 501, 1000]
    info = PreparedDataset(tmp_path / "out").info
    assert info["skipped_rows"] == 3 and info["bad_rows"][1].startswith(f"{path}:501: field C3")
    all_bad = write_lines(tmp_path / "all_bad.tsv", [BAD_CASES["label 2"][0]] * 3)
    with pytest.raises(CriteoFormatError, match="no valid rows"):
        prepare_criteo([all_bad], tmp_path / "none", skip_bad_rows=True, progress=False)
    assert not (tmp_path / "none").exists()


def test_skip_bad_rows_keeps_first_100_locations(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    lines = [rand_line(rng) if i % 3 else "1\tx" for i in range(600)]  # 200 bad rows
    path = write_lines(tmp_path / "many_bad.tsv", lines)
    reader = CriteoReader(path, skip_bad_rows=True)
    assert sum(len(c) for c in reader) == 400
    assert reader.skipped == 200 and [b.line for b in reader.bad_rows] == list(range(1, 300, 3))


def naive_sparse(lines: list[str]) -> np.ndarray:
    return np.array([[int(v, 16) if v else 0 for v in (s.split("\t") + [""] * 40)[14:40]] for s in lines])


# ------------------------------------------------------------------------------------------- details
def test_values_edge_cases(tmp_path: Path) -> None:
    f = GOOD.split("\t")
    f[1:14] = ["-3", "", "0", "007", "123456789012", "-123456789", "99999999", "1", "", "", "", "", "5"]
    f[14:18] = ["ABCDEF01", "abcdef01", "1", ""]
    path = write_lines(tmp_path / "edge.tsv", ["\t".join(f), "\t".join(f[:14])], final_newline=False)
    labels, dense, cats = read_all(path, transform=False)
    assert dense[0].tolist() == [-3, 0, 0, 7, 123456789012, -123456789, 99999999, 1, 0, 0, 0, 0, 5]
    assert cats[0, :4].tolist() == [0xABCDEF01, 0xABCDEF01, 1, 0]
    assert cats[1].tolist() == [0] * 26 and dense[1].tolist() == dense[0].tolist()
    _, logd, _ = read_all(path)
    assert logd[0, 0] == 0.0 and logd[0, 5] == 0.0  # negatives clamp to 0 before log(1 + x)
    assert logd[0, 3] == np.float32(math.log1p(7))


def test_vocab_counter_over_many_uneven_chunks() -> None:
    rng = np.random.default_rng(6)
    raw = rng.zipf(1.5, size=(5000, 3)) % 3000  # heavy-tailed, with zeros (missing)
    counter = VocabCounter(3)
    for lo, hi in zip([0, 1, 8, 300, 301, 2500], [1, 8, 300, 301, 2500, 5000], strict=True):
        counter.add(raw[lo:hi])
    for min_freq in (1, 4):
        vocabs = counter.vocabularies(min_freq)
        want_ids, want_sizes = vocab_ids(raw, min_freq)
        assert [len(v) + 1 for v in vocabs] == want_sizes
        np.testing.assert_array_equal(apply_vocabularies(raw, vocabs), want_ids)


def test_valid_rows_stay_on_the_vectorised_path(real: Path, tmp_path: Path, monkeypatch) -> None:
    """Only bad lines or dense values over 8 digits go through the per-line parser (it is ~10x slower)."""
    import recstack.data.prepare.criteo as criteo

    calls = []
    monkeypatch.setattr(criteo, "_parse_fields", lambda f: calls.append(f) or _parse_fields(f))
    f = GOOD.split("\t")
    f[1:4] = ["-1234567", "", "-1"]
    f[14:18] = ["ABCDEF01", "aBc", "0", ""]
    lines = [*RAW1000.read_text().splitlines(), "\t".join(f), "\t".join(f[:20])]
    read_all(write_lines(tmp_path / "mixed.tsv", lines))
    assert calls == []
    f[5], f[6] = "123456789", "-12345678"
    _, dense, _ = read_all(write_lines(tmp_path / "long.tsv", lines + ["\t".join(f)]), transform=False)
    assert len(calls) == 1 and dense[-1, 4:6].tolist() == [123456789, -12345678]


def test_sort_day_files() -> None:
    names = ["day_10.gz", "day_2.gz", "day_0.gz", "day_1.gz", "day_23.gz"]
    assert [p.name for p in sort_day_files(names)] == ["day_0.gz", "day_1.gz", "day_2.gz", "day_10.gz", "day_23.gz"]


# Characters that make the fast path's byte tricks interesting: every digit / hex class boundary,
# a high byte, the sign, and the separators.
ALPHABET = st.sampled_from(list("0123456789abcdefABCDEF/:@G`gx-+ .\x7f\xe9") + ["\t", "\t", "", "12345678"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(ALPHABET, max_size=60).map("".join), min_size=1, max_size=8), st.data())
def test_fast_path_agrees_with_line_parser(noise: list[str], data: st.DataObject) -> None:
    """Random mutations of valid rows: the vectorised parser accepts exactly the lines the per-line parser
    accepts, with identical values."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    lines = []
    for s in noise:
        f = rand_line(rng, fields=data.draw(st.integers(12, 41))).split("\t")
        f[data.draw(st.integers(0, len(f) - 1))] = s.split("\t")[0][:12]
        lines.append("\t".join(f) if data.draw(st.booleans()) else s)
    buf = ("\n".join(lines) + "\n").encode("utf-8")
    block = _parse_block(buf)
    want, bad = [], []
    for i, line in enumerate(buf.split(b"\n")[:-1]):
        try:
            want.append(_parse_fields(line.split(b"\t")))
        except _RowError:
            bad.append(i)
    assert [i for i, _ in block.bad] == bad
    assert block.labels.tolist() == [w[0] for w in want]
    assert block.dense.tolist() == [w[1] for w in want]
    assert block.sparse.tolist() == [w[2] for w in want]
