"""Delta artifacts: a version that holds the dense program and only the table rows that changed since the version
it applies to (its base), written by ``publish.Publisher`` and applied by ``ServingModel.load(..., base=...)``.

Layout (``MODEL_ROOT/<version>/``, beside full versions; docs/serving.md "Publishing while training")::

    manifest.json            a full artifact's manifest (tables, table_files describe the *result*) plus "delta"
    dense.pt2                the whole dense program (it changes every step)
    delta/<group>.rows.npy   int64 [n]: the changed rows of that table group (strictly increasing)
    delta/<group>.npy        their new codes [n, cols], the group's dtype
    delta/<group>.sb.npy     int8 / int4: their new (scale, bias) float16 [n, 2]
    transforms.json, ...     only when the feature transforms changed (else "transforms": "base")

``manifest["delta"]``: ``base`` {"version", "manifest_sha256"} (the base's manifest file, so a base number that
was reused by another run is refused too), ``full`` (the full version the chain starts at), ``chain`` (deltas
since it, this one included), ``groups`` {group: {"rows", "data", "scale_bias", "changed"}}, ``table_sha256``
{table: sha256 of its rows in the result: codes then scale/bias, as ``table_digest``} for every table a changed row
lies in, ``changed_rows`` / ``total_rows``, ``transforms``.

Applying one: every file's checksum (``read_manifest``), then for each group with changes a new array (the base's
rows copied, the changed ones set: the served arrays are never written) whose touched tables must hash to
``table_sha256``; groups without changes are the base's objects, neither read nor hashed again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recstack.serving.artifact import ArtifactError
from recstack.serving.quantized import GroupArrays, QuantizedRows

DELTA_DIR = "delta"


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's values as unsigned integers of their size: compared bit for bit (-0.0 is not 0.0)."""
    return a.view(f"u{a.dtype.itemsize}")


def changed_rows(new: GroupArrays, old: GroupArrays) -> dict[str, np.ndarray]:
    """group -> int64 [n] indices of the rows whose codes or scale/bias differ between ``old`` and ``new``
    (same keys and shapes)."""
    out = {}
    for key, (codes, sb) in new.items():
        old_codes, old_sb = old[key]
        diff = (_bits(codes) != _bits(old_codes)).any(axis=1)
        if sb is not None and old_sb is not None:
            diff |= (_bits(sb) != _bits(old_sb)).any(axis=1)
        out[key] = np.flatnonzero(diff).astype(np.int64)
    return out


def table_digest(codes: np.ndarray, sb: np.ndarray | None, offset: int, rows: int) -> str:
    """sha256 of one table's rows of its group: codes [offset, offset + rows) then their scale/bias."""
    h = hashlib.sha256(np.ascontiguousarray(codes[offset:offset + rows]).data)
    if sb is not None:
        h.update(np.ascontiguousarray(sb[offset:offset + rows]).data)
    return h.hexdigest()


def touched_tables(tables: list[dict[str, Any]], key: str, rows: np.ndarray) -> list[dict[str, Any]]:
    """The manifest table entries of group ``key`` that hold at least one of ``rows``."""
    out = []
    for t in tables:
        if t["group"] == key:
            lo = np.searchsorted(rows, t["offset"])
            if lo < len(rows) and rows[lo] < t["offset"] + t["rows"]:
                out.append(t)
    return out


def write_delta_tables(tmp: Path, arrays: GroupArrays, changed: dict[str, np.ndarray],
                       tables: list[dict[str, Any]]) -> dict[str, Any]:
    """The changed rows of every group into ``tmp/delta/`` -> the manifest's delta "groups" and "table_sha256"."""
    (tmp / DELTA_DIR).mkdir(exist_ok=True)
    groups: dict[str, Any] = {}
    digests: dict[str, str] = {}
    for key, rows in changed.items():
        if not len(rows):
            continue
        codes, sb = arrays[key]
        stem = f"{DELTA_DIR}/{key}"
        rel_rows, rel_data, rel_sb = f"{stem}.rows.npy", f"{stem}.npy", f"{stem}.sb.npy"
        np.save(tmp / rel_rows, rows, allow_pickle=False)
        np.save(tmp / rel_data, codes[rows], allow_pickle=False)
        if sb is not None:
            np.save(tmp / rel_sb, sb[rows], allow_pickle=False)
        groups[key] = {"rows": rel_rows, "data": rel_data, "scale_bias": rel_sb if sb is not None else None,
                       "changed": int(len(rows))}
        for t in touched_tables(tables, key, rows):
            digests[t["name"]] = table_digest(codes, sb, t["offset"], t["rows"])
    return {"groups": groups, "table_sha256": digests}


def _host(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy()


def apply_delta(base_groups: dict[str, QuantizedRows], base_manifest: dict[str, Any], path: Path,
                manifest: dict[str, Any], read: Callable[[str], np.ndarray],
                device: torch.device) -> dict[str, QuantizedRows]:
    """The table groups of delta ``path`` applied to a served model's groups (never modified). ``read(rel)``:
    an array of the delta, checked against its checksum. Raises ArtifactError naming what does not fit."""
    where = path / "manifest.json"
    delta = manifest["delta"]
    if manifest["tables"] != base_manifest["tables"] or manifest["table_files"] != base_manifest["table_files"]:
        raise ArtifactError(f"{where}: its table layout is not its base's (version {delta['base']['version']})")
    unknown = set(delta["groups"]) - set(manifest["table_files"])
    if unknown:
        raise ArtifactError(f"{where}: delta group {sorted(unknown)[0]!r} is no table group of the model")
    out: dict[str, QuantizedRows] = {}
    for key, f in manifest["table_files"].items():
        g = base_groups[key]
        entry = delta["groups"].get(key)
        if entry is None:
            out[key] = g  # unchanged: the served object itself
            continue
        n_rows, cols = f["data_shape"]
        rows = read(entry["rows"])
        if rows.dtype != np.int64 or rows.ndim != 1 or len(rows) != entry["changed"] or not len(rows):
            raise ArtifactError(f"{path / entry['rows']}: expected int64 [{entry['changed']}] row indices, got "
                                f"{rows.dtype} {list(rows.shape)}")
        if rows[0] < 0 or rows[-1] >= n_rows or (len(rows) > 1 and not (np.diff(rows) > 0).all()):
            raise ArtifactError(f"{path / entry['rows']}: row indices not increasing in [0, {n_rows})")
        codes = read(entry["data"])
        if codes.dtype != np.dtype(f["data_dtype"]) or list(codes.shape) != [len(rows), cols]:
            raise ArtifactError(f"{path / entry['data']}: {codes.dtype} {list(codes.shape)}, expected "
                                f"{f['data_dtype']} {[len(rows), cols]}")
        idx = torch.from_numpy(rows).to(g.data.device)
        data = g.data.clone()  # copy on write: requests still scoring the base read the old array
        data[idx] = torch.from_numpy(codes).to(data.device)
        sb = None
        if g.scale_bias is not None:
            if not entry["scale_bias"]:
                raise ArtifactError(f"{where}: group {key!r} needs scale/bias rows")
            new_sb = read(entry["scale_bias"])
            if new_sb.dtype != np.float16 or list(new_sb.shape) != [len(rows), 2]:
                raise ArtifactError(f"{path / entry['scale_bias']}: {new_sb.dtype} {list(new_sb.shape)}, "
                                    f"expected float16 {[len(rows), 2]}")
            sb = g.scale_bias.clone()
            sb[idx] = torch.from_numpy(new_sb).to(sb.device)
        host_codes, host_sb = data.cpu().numpy(), _host(sb)
        for t in touched_tables(manifest["tables"], key, rows):
            want = delta["table_sha256"].get(t["name"])
            if want is None or table_digest(host_codes, host_sb, t["offset"], t["rows"]) != want:
                raise ArtifactError(f"{where}: table {t['name']!r} after the delta does not match its checksum "
                                    f"(a damaged delta, or a base other than the one it was made on)")
        out[key] = QuantizedRows(g.width, g.dim, data, sb, device)
    return out


def delta_base(manifest: dict[str, Any]) -> int | None:
    """The base version of a delta's manifest; None for a full artifact."""
    delta = manifest.get("delta")
    return int(delta["base"]["version"]) if isinstance(delta, dict) else None


# -- dynamic id maps --------------------------------------------------------------------------------------------
# A dynamic table's map travels as its rows' owners: row r of a table of C rows is owned by one raw id or by none
# (-1). A delta carries the rows whose owner changed (admitted, evicted, reassigned) and their new owners.
IdMap = tuple[np.ndarray, np.ndarray]  # (raw ids [K] int64 ascending, their rows [K] int64)


def row_owners(id_map: IdMap, rows: int) -> np.ndarray:
    """int64 [rows]: the raw id each row holds, -1 where none."""
    owners = np.full(rows, -1, np.int64)
    owners[id_map[1]] = id_map[0]
    return owners


def owners_to_map(owners: np.ndarray) -> IdMap:
    """The inverse of ``row_owners``: (ids ascending, their rows)."""
    rows = np.flatnonzero(owners >= 0).astype(np.int64)
    ids = owners[rows]
    order = np.argsort(ids, kind="stable")
    return ids[order], rows[order]


def id_map_digest(id_map: IdMap) -> str:
    h = hashlib.sha256(np.ascontiguousarray(id_map[0], np.int64).data)
    h.update(np.ascontiguousarray(id_map[1], np.int64).data)
    return h.hexdigest()


def write_delta_id_maps(tmp: Path, new: dict[str, IdMap], old: dict[str, IdMap],
                        capacity: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Each table's changed row owners into ``tmp/delta/`` -> the delta manifest's "dynamic_ids" entries:
    {table: {"owner_rows", "owners", "changed", "count", "sha256" (of the resulting map)}}."""
    (tmp / DELTA_DIR).mkdir(exist_ok=True)
    out: dict[str, dict[str, Any]] = {}
    for name, m in new.items():
        now, before = row_owners(m, capacity[name]), row_owners(old[name], capacity[name])
        rows = np.flatnonzero(now != before).astype(np.int64)
        rel_rows, rel_owners = f"{DELTA_DIR}/ids.{name}.rows.npy", f"{DELTA_DIR}/ids.{name}.owners.npy"
        np.save(tmp / rel_rows, rows, allow_pickle=False)
        np.save(tmp / rel_owners, now[rows], allow_pickle=False)
        out[name] = {"owner_rows": rel_rows, "owners": rel_owners, "changed": int(len(rows)),
                     "count": int(len(m[0])), "sha256": id_map_digest(m)}
    return out


def apply_id_map_delta(base: IdMap, entry: dict[str, Any], capacity: int, path: Path,
                       read: Callable[[str], np.ndarray]) -> IdMap:
    """A table's id map after delta ``path``'s ``entry`` (the base's map is not modified); ArtifactError when the
    files do not fit or the result is not the one the publisher had."""
    rows, owners = read(entry["owner_rows"]), read(entry["owners"])
    n = int(entry["changed"])
    if rows.dtype != np.int64 or owners.dtype != np.int64 or rows.shape != (n,) or owners.shape != (n,):
        raise ArtifactError(f"{path / entry['owner_rows']}: expected int64 [{n}] rows and owners")
    if n and (rows.min() < 0 or rows.max() >= capacity):
        raise ArtifactError(f"{path / entry['owner_rows']}: rows outside the table's {capacity}")
    now = row_owners(base, capacity)
    now[rows] = owners
    result = owners_to_map(now)
    if len(result[0]) != entry["count"] or id_map_digest(result) != entry["sha256"]:
        raise ArtifactError(f"{path / 'manifest.json'}: an id map after the delta does not match its checksum (a "
                            "damaged delta, or a base other than the one it was made on)")
    return result
