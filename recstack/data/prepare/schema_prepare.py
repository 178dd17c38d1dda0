"""``recstack data prepare --schema``: any schema-described input -> prepared train/valid/test directories.

Two streaming passes with bounded memory (one chunk of rows at a time; the only state that grows is the
vocabulary counts): the first reads the training rows for the statistics (vocabularies, standardize
moments; skipped when no feature needs them or ``stats_from`` gives them), the second encodes every row and
appends it to the output of its split.

Splits: by file (``valid_inputs`` / ``test_inputs``), by fraction (a hash of file and line/row number, so
the assignment is the same on every run and does not move when bad rows are skipped) or by time (the
schema's timestamp column against ``valid_from`` / ``test_from``). With a split the outputs are
``OUT/train``, ``OUT/valid`` and ``OUT/test``; without one, ``OUT`` itself. The training output also holds
``stats.json`` (vocabularies, dense statistics) so that later files can be prepared the same way.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from recstack.data.format import PreparedFormatError
from recstack.data.prepare.columns import uniform_hash
from recstack.data.prepare.encode import Encoder, EncodingState, ParsedChunk, StatsCollector, needs_stats, parse_chunk
from recstack.data.prepare.readers import BadRow, BadRowLog, DataError, expand_inputs, open_source
from recstack.data.prepare.schema import Schema, SchemaError, split_time
from recstack.data.prepared_writer import PreparedWriter
from recstack.io import read_json

SPLIT_NAMES = ("train", "valid", "test")
STATS_FILE = "stats.json"


@dataclass
class PrepareReport:
    outputs: dict[str, Path]
    rows: dict[str, int]
    skipped: int
    bad_rows: list[BadRow]
    seconds: float
    tables: dict[str, int] = field(default_factory=dict)

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())

    @property
    def rows_per_sec(self) -> float:
        return self.total_rows / self.seconds if self.seconds > 0 else 0.0


def _splits_used(schema: Schema, valid: list[Path], test: list[Path]) -> list[str]:
    sp = schema.split
    if valid or test:
        return ["train", *(["valid"] if valid else []), *(["test"] if test else [])]
    if sp.method == "fraction":
        return ["train", *(["valid"] if sp.valid > 0 else []), *(["test"] if sp.test > 0 else [])]
    if sp.method == "time":
        return ["train", *(["valid"] if sp.valid_from is not None else []),
                *(["test"] if sp.test_from is not None else [])]
    return ["all"]


def assign_splits(p: ParsedChunk, schema: Schema, fixed: int | None) -> np.ndarray:
    """-> int8 [n]: 0 train, 1 valid, 2 test. ``fixed``: the split of a whole file (by-file splits)."""
    n = len(p)
    if fixed is not None:
        return np.full(n, fixed, np.int8)
    sp = schema.split
    out = np.zeros(n, np.int8)
    if sp.method == "fraction":
        u = uniform_hash(np.full(n, p.file_index), p.ordinals, sp.seed)
        out[u < sp.valid] = 1
        out[(u >= sp.valid) & (u < sp.valid + sp.test)] = 2
    elif sp.method == "time":
        assert p.timestamp is not None
        v, t = split_time(sp.valid_from), split_time(sp.test_from)
        if v is not None:
            out[p.timestamp >= v] = 1
        if t is not None:
            out[p.timestamp >= t] = 2
    return out


class _Inputs:
    """The input files with their fixed split (by-file) and a shared progress bar."""

    def __init__(self, schema: Schema, groups: list[tuple[list[Path], int | None]], chunk_rows: int) -> None:
        self.schema, self.groups, self.chunk_rows = schema, groups, chunk_rows

    def chunks(
        self, log: BadRowLog, only_train: bool, progress: bool, desc: str
    ) -> Iterator[tuple[ParsedChunk, int | None]]:
        files = [(f, fixed) for group, fixed in self.groups for f in group if not (only_train and fixed)]
        sources = [open_source(f, self.schema.source, self.chunk_rows, log) for f, _ in files]
        units = {s.size_unit for s in sources}
        bar = tqdm(total=sum(s.size for s in sources), disable=not progress, desc=desc,
                   unit=units.pop() if len(units) == 1 else "it", unit_scale=True, dynamic_ncols=True)
        columns = self.schema.input_columns()
        try:
            for file_index, (source, (_, fixed)) in enumerate(zip(sources, files, strict=True)):
                seen = 0
                for raw in source.chunks(columns, file_index):
                    yield parse_chunk(raw, self.schema, log), fixed
                    bar.update(source.progress - seen)
                    seen = source.progress
        finally:
            bar.close()


def prepare_dataset(
    schema: Schema,
    inputs: list[str | Path],
    out: str | Path,
    *,
    valid_inputs: list[str | Path] = (),  # type: ignore[assignment]
    test_inputs: list[str | Path] = (),  # type: ignore[assignment]
    stats_from: str | Path | None = None,
    skip_bad_rows: bool = False,
    overwrite: bool = False,
    chunk_rows: int = 65536,
    progress: bool = True,
) -> PrepareReport:
    """Read ``inputs`` (files or directories) with ``schema`` and write prepared directories under ``out``."""
    t0 = time.perf_counter()
    out = Path(out)
    train_files = expand_inputs(list(inputs), schema.source)
    valid_files = expand_inputs(list(valid_inputs), schema.source)
    test_files = expand_inputs(list(test_inputs), schema.source)
    if (valid_files or test_files) and schema.split.method != "none":
        raise SchemaError(f"{schema.origin}: split.method = {schema.split.method!r} and split files given; "
                          "choose one")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass --overwrite to replace it)")
    splits = _splits_used(schema, valid_files, test_files)
    by_file = bool(valid_files or test_files)
    groups = [(train_files, 0 if by_file else None), (valid_files, 1), (test_files, 2)]
    inputs_ = _Inputs(schema, [g for g in groups if g[0]], chunk_rows)

    stats_file = None
    if stats_from is not None:
        stats_file = _stats_file(Path(stats_from))
        state = load_state(stats_file)
    elif needs_stats(schema):
        collector = StatsCollector(schema)
        for p, fixed in inputs_.chunks(BadRowLog(skip=skip_bad_rows), True, progress, "statistics"):
            collector.update(p, assign_splits(p, schema, fixed) == 0)
        state = collector.state()
    else:
        state = EncodingState()
    encoder = Encoder(schema, state, str(stats_file) if stats_file else None)

    specs = encoder.feature_specs()
    c = schema.columns
    extras = {k: dt for k, dt, col in (("example_id", "int64", c.example_id), ("timestamp", "int64", c.timestamp),
                                       ("vertical", "int32", c.vertical)) if col}
    dirs = {s: out if s == "all" else out / s for s in splits}
    created = not out.exists()  # removed again if this run fails
    writers: dict[str, PreparedWriter] = {}
    log = BadRowLog(skip=skip_bad_rows)
    rows = dict.fromkeys(splits, 0)
    index = {name: i for i, name in enumerate(SPLIT_NAMES)}
    try:
        if len(splits) > 1:
            out.mkdir(parents=True, exist_ok=True)
        for s, d in dirs.items():
            writers[s] = PreparedWriter(d, [x.name for x in schema.dense], specs, extras, overwrite=True)
        for p, fixed in inputs_.chunks(log, False, progress, "prepare"):
            arrays = encoder.encode(p)
            if splits == ["all"]:
                writers["all"].write(**arrays)
                rows["all"] += len(p)
                continue
            which = assign_splits(p, schema, fixed)
            for s in splits:
                m = which == index[s]
                if m.any():
                    writers[s].write(**_select(arrays, m))
                    rows[s] += int(m.sum())
        if not sum(rows.values()):
            names = ", ".join(str(f) for g, _ in groups for f in g)
            why = f"no valid rows ({log.count} bad rows skipped)" if log.count else "no rows in the inputs"
            raise DataError(names, None, None, why)
        tables = {sp.table_name: sp.num_embeddings for sp in specs}
        for s, w in writers.items():
            w.info = {
                "reader": "schema", "split": s, "schema": schema.to_dict(), "tables": tables,
                "inputs": [str(f) for g, fixed in groups for f in g if fixed in (None, index.get(s))],
                "dense_stats": {k: list(v) for k, v in state.dense.items()},
                "verticals": list(state.verticals), "skipped_rows": log.count,
            }
            if s in ("all", "train"):
                (w.tmp_dir / STATS_FILE).write_text(json.dumps(state.to_dict()))
        for w in writers.values():
            w.close()
        if len(splits) > 1:  # an output of an earlier run that this run did not write would be stale
            for stale in set(SPLIT_NAMES) - set(splits):
                if (out / stale / "meta.json").is_file():
                    shutil.rmtree(out / stale)
            _remove_unsplit_output(out)
    except BaseException:
        for w in writers.values():
            w.abort()
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return PrepareReport(dirs, rows, log.count, log.rows, time.perf_counter() - t0,
                         {sp.table_name: sp.num_embeddings for sp in specs})


def _remove_unsplit_output(out: Path) -> None:
    """Remove the files of an earlier output without a split from ``out`` (now the parent of the split
    outputs): its meta.json, the arrays it lists, stats.json and Criteo's vocab.npz. Anything else in
    ``out`` stays."""
    meta = out / "meta.json"
    if not meta.is_file():
        return
    try:
        arrays = read_json(meta, ValueError).get("arrays", {})
        files = [str(a["file"]) for a in arrays.values()]
    except (ValueError, AttributeError, KeyError, TypeError):  # not a prepared directory's meta.json
        return
    for name in [*files, STATS_FILE, "vocab.npz"]:
        f = out / name
        if f.parent == out and f.is_file():
            f.unlink()
    meta.unlink()


def _select(arrays: dict, m: np.ndarray) -> dict:
    """The rows of mask m [n] of one encoded chunk (jagged features included)."""
    out = {}
    for k, v in arrays.items():
        if k != "jagged":
            out[k] = v[m]
            continue
        out[k] = {}
        for name, (lengths, ids, w) in v.items():
            keep = np.repeat(m, lengths)
            out[k][name] = (lengths[m], ids[keep], w[keep] if w is not None else None)
    return out


def _stats_file(path: Path) -> Path:
    return path / STATS_FILE if path.is_dir() else path


def load_state(path: Path) -> EncodingState:
    """Statistics of an earlier prepare (its training output directory, or the stats.json file)."""
    f = _stats_file(path)
    if not f.is_file():
        raise FileNotFoundError(f"{f}: no statistics file (prepare the training split first)")
    return EncodingState.from_dict(read_json(f, PreparedFormatError))
