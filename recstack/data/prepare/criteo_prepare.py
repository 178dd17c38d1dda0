"""``recstack data prepare``: raw Criteo files -> the prepared columnar format, with bounded memory.

Reads with :class:`recstack.data.prepare.criteo.CriteoReader` (one pass with hashing, two with a vocabulary), writes
with :class:`recstack.data.prepared_writer.PreparedWriter`, and shows rows/s on a progress bar.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from recstack.data.format import SparseFeatureSpec
from recstack.data.prepare.criteo import (
    DENSE_NAMES,
    DENSE_TRANSFORM,
    NUM_SPARSE,
    SPARSE_NAMES,
    BadRow,
    CriteoFormatError,
    CriteoReader,
)
from recstack.data.prepare.criteo_vocab import VocabCounter, apply_vocabularies
from recstack.data.prepared_writer import PreparedWriter


def sort_day_files(paths: Sequence[str | Path]) -> list[Path]:
    """Sort file names naturally, so day_2 comes before day_10 (Terabyte day_0 .. day_23)."""

    def key(p: Path) -> list[tuple[int, int | str]]:
        return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", p.name) if t]

    return sorted((Path(p) for p in paths), key=lambda p: (key(p), str(p)))


@dataclass
class PrepareReport:
    """What ``prepare_criteo`` wrote: kept rows, skipped bad rows (first 100 located), wall time, tables."""

    out_dir: Path
    rows: int
    skipped: int
    bad_rows: list[BadRow]
    seconds: float
    rows_per_sec: float
    table_sizes: list[int]
    rows_per_input: list[int] = field(default_factory=list)
    dropped_negatives: int = 0


class NegativeSampler:
    """Keeps every positive row and each negative one with probability 1 - ``rate`` (the DLRM reference's
    ``--data-sub-sample-rate``). Row j of input i is kept by the j-th uniform draw of a generator seeded
    (seed, i), so the counting and the writing pass, and any chunk size, keep the same rows."""

    def __init__(self, rate: float, seed: int) -> None:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"sub_sample_rate must be in [0, 1), got {rate}")
        self.rate, self.seed = rate, seed
        self.rng = np.random.default_rng([seed, 0])

    def start(self, input_index: int) -> None:
        self.rng = np.random.default_rng([self.seed, input_index])

    def keep(self, labels: np.ndarray) -> np.ndarray | None:
        """labels [n] -> bool mask [n] of the rows to keep, or None when every row is kept."""
        if self.rate == 0.0:
            return None
        return (labels > 0) | (self.rng.random(len(labels)) >= self.rate)


def prepare_criteo(
    inputs: list[Path],
    out_dir: Path,
    *,
    max_ind_range: int | None = None,
    vocab_min_freq: int | None = None,
    skip_bad_rows: bool = False,
    chunk_rows: int = 262144,
    progress: bool = True,
    overwrite: bool = False,
    sub_sample_rate: float = 0.0,
    sub_sample_seed: int = 0,
) -> PrepareReport:
    """Convert raw Criteo files (plain or gzipped, concatenated in the order given: pass day files in time
    order, e.g. through :func:`sort_day_files`) into the prepared format at ``out_dir``.

    Columns: labels float32 [N]; dense float32 [N, 13] named I1..I13 = log(1 + max(x, 0)), missing -> 0;
    sparse int32 [N, 26] named C1..C26. Categorical ids, exactly one of:

    * ``max_ind_range=R`` (hashing, one pass): id = raw value % R, every table has R rows; missing -> 0
      (shared with values that hash to 0, as in the reference DLRM preprocessing).
    * ``vocab_min_freq=k`` (two passes): a first pass counts every feature's values; values seen at least k
      times get ids 1..V in ascending raw-value order, missing / rarer values -> 0, table size V + 1. The
      counting memory grows with the number of distinct values (about 12 bytes each; fine for Kaggle, many
      GiB for Terabyte, where hashing is the practical choice). The sorted kept values are saved as
      ``vocab.npz`` (arrays C1..C26) so other data can be mapped the same way.

    With neither given the default is ``vocab_min_freq=1`` (the reference Kaggle preprocessing: every value
    seen gets its own row). Bad rows raise :class:`CriteoFormatError` before anything is written for the
    vocabulary mode, or abort the write in hashing mode; with ``skip_bad_rows`` they are dropped, counted
    and their first 100 locations stored in ``meta.json`` ``info``.

    ``sub_sample_rate=r`` drops each negative row with probability r and keeps every positive (the reference's
    Terabyte training days use 0.875; prepare the evaluation day without it). A vocabulary then counts the
    kept rows only. Predictions of a model trained on such data overstate the click rate: p / (p + (1 - p) /
    (1 - r)) maps them back.
    """
    t0 = time.perf_counter()
    inputs = [Path(p) for p in inputs]
    out_dir = Path(out_dir)
    if not inputs:
        raise ValueError("no input files given")
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(f"input file {p} does not exist")
    if max_ind_range is not None and vocab_min_freq is not None:
        raise ValueError("give max_ind_range (hashing) or vocab_min_freq (vocabulary), not both")
    if max_ind_range is None and vocab_min_freq is None:
        vocab_min_freq = 1
    if max_ind_range is not None and not 1 <= max_ind_range <= np.iinfo(np.int32).max:
        raise ValueError(f"max_ind_range must be in [1, 2**31 - 1] (ids are int32), got {max_ind_range}")
    if vocab_min_freq is not None and vocab_min_freq < 1:
        raise ValueError(f"vocab_min_freq must be >= 1, got {vocab_min_freq}")
    sampler = NegativeSampler(sub_sample_rate, sub_sample_seed)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite to replace it)")

    def readers(transform: bool = True) -> Iterator[CriteoReader]:
        for i, p in enumerate(inputs):
            sampler.start(i)
            yield CriteoReader(p, chunk_rows=chunk_rows, skip_bad_rows=skip_bad_rows, transform=transform)

    vocabs: list[np.ndarray] | None = None
    if vocab_min_freq is not None:
        counter = VocabCounter(NUM_SPARSE)
        with tqdm(desc="counting values", unit=" rows", unit_scale=True, disable=not progress) as bar:
            for reader in readers(transform=False):  # the counting pass needs no dense values
                for chunk in reader:
                    keep = sampler.keep(chunk.labels)
                    counter.add(chunk.sparse if keep is None else chunk.sparse[keep])
                    bar.update(len(chunk))
        vocabs = counter.vocabularies(vocab_min_freq)
        table_sizes = [len(v) + 1 for v in vocabs]
        if max(table_sizes) > np.iinfo(np.int32).max:
            raise ValueError(f"a vocabulary has {max(table_sizes) - 1} values, more than int32 ids allow")
        mapping: dict[str, object] = {
            "mode": "vocabulary",
            "min_freq": vocab_min_freq,
            "file": "vocab.npz",
            "order": "ascending raw value; 0 = missing, rare or unseen",
        }
    else:
        assert max_ind_range is not None
        table_sizes = [max_ind_range] * NUM_SPARSE
        mapping = {"mode": "hash", "max_ind_range": max_ind_range, "formula": "raw % max_ind_range"}

    # Vocabulary ids: row 0 is missing, rare and unseen (starts at zero in a new model); hashed ids have none.
    reserved = 1 if vocab_min_freq is not None else 0
    specs = [SparseFeatureSpec(name, size, reserved_rows=reserved)
             for name, size in zip(SPARSE_NAMES, table_sizes, strict=True)]
    bad_rows: list[BadRow] = []
    skipped = dropped = 0
    per_input: list[int] = []
    with (
        PreparedWriter(out_dir, DENSE_NAMES, specs, overwrite=overwrite) as writer,
        tqdm(desc="writing", unit=" rows", unit_scale=True, disable=not progress) as bar,
    ):
        for reader in readers():
            for chunk in reader:
                if vocabs is not None:
                    ids = apply_vocabularies(chunk.sparse, vocabs)
                else:
                    ids = (chunk.sparse % max_ind_range).astype(np.int32)
                keep = sampler.keep(chunk.labels)
                if keep is None:
                    writer.write(chunk.labels, chunk.dense, ids)
                else:
                    writer.write(chunk.labels[keep], chunk.dense[keep], ids[keep])
                    dropped += len(keep) - int(keep.sum())
                bar.update(len(chunk))
            per_input.append(reader.rows)
            skipped += reader.skipped
            bad_rows.extend(reader.bad_rows[: 100 - len(bad_rows)])
        if writer.num_rows == 0:
            why = f"no valid rows ({skipped} bad rows skipped)"
            raise CriteoFormatError(", ".join(map(str, inputs)), None, None, None, why)
        if vocabs is not None:
            arrays: dict[str, Any] = dict(zip(SPARSE_NAMES, vocabs, strict=True))
            np.savez(writer.tmp_dir / "vocab.npz", **arrays)
        writer.info.update(
            {
                "source": "criteo",
                "inputs": [str(p) for p in inputs],
                "rows_per_input": per_input,
                "dense_transform": DENSE_TRANSFORM,
                "categorical": mapping,
                "skipped_rows": skipped,
                "bad_rows": [str(b) for b in bad_rows],
                "negative_sub_sampling": {"rate": sub_sample_rate, "seed": sub_sample_seed,
                                          "dropped_negatives": dropped},
            }
        )
        rows = writer.num_rows
    seconds = time.perf_counter() - t0
    return PrepareReport(out_dir, rows, skipped, bad_rows, seconds, rows / seconds, table_sizes, per_input,
                         dropped)
