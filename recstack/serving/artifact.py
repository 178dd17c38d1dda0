"""The serving artifact on disk: a versioned directory that ``recstack export`` writes and ``ServingModel.load``
reads, with a manifest that lists every file's checksum and size.

Layout (``MODEL_ROOT/<version>/`` when exported into a versions directory, ``version`` an increasing integer)::

    manifest.json        format, format_version, version, source checkpoint, model config, features, tables,
                         dense program, transforms, and {relative path: {"sha256", "bytes"}} of every other file
    dense.pt2            torch.export program: pooled embeddings [B, F', D] (+ dense [B, n_dense]) -> logits [B]
    tables/<width>.npy   the rows of every table of that width, stacked (manifest ``tables[*].offset``):
                         float32 / float16 [rows, D], int8 codes uint8 [rows, D] or int4 codes two a byte
                         uint8 [rows, ceil(D / 2)], codes padded to whole 4-byte words
    tables/<width>.sb.npy  int8 / int4 only: per-row (scale, bias) float16 [rows, 2]
                         (with per-table dims, ``model.table_dims``: one group per width and dim,
                         ``tables/<width>_d<dim>.npy``; the dense program then takes pooled [B, sum of dims])
    transforms.json      how raw feature values become model inputs (``recstack.serving.transforms``)
    transforms/*.npy     large transform arrays (the Criteo vocabularies' sorted keys)

Every array is a plain ``.npy`` (read whole and checked on the bytes read, ``read_array``; ``allow_pickle``
never set) and every text a JSON file: nothing here is unpickled. A directory is written as ``.<name>.tmp-*``
beside its target, fsynced and renamed, so a watcher sees a complete artifact or none.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from recstack.errors import RecstackError
from recstack.io import disk_error, fsync_dir, os_error_in

FORMAT_NAME = "recstack-serving-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^[0-9]+$")


class ArtifactError(RecstackError, ValueError):
    """A serving artifact is missing, incomplete, truncated, tampered with or of another format; the message
    names the directory and the file."""


class RequestError(RecstackError, ValueError):
    """A scoring request breaks the model's input contract. ``field``: the feature / key at fault (None when
    the request as a whole is wrong), ``row``: its row index in the request (None when not one row's)."""

    def __init__(self, message: str, field: str | None = None, row: int | None = None) -> None:
        self.field, self.row = field, row
        where = f"row {row}: " if row is not None else ""
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(where + what + message)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entries(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"sha256", "bytes"}} of every file under ``root`` but the manifest, sorted."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


def read_manifest(model_dir: str | Path, verify: bool = True,
                  hashed_when_read: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The manifest of an artifact directory; with ``verify`` every file it lists is checked (size, then
    sha256) and every file it does not list refused. Raises ArtifactError naming the file at fault.
    ``hashed_when_read(rel)``: files whose sha256 the caller checks on the bytes it reads (``read_array``),
    so that they are not read twice."""
    root = Path(model_dir)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{root}: not a serving artifact (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ArtifactError(f"{path}: not a {FORMAT_NAME} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format_version {manifest.get('format_version')!r}, this recstack reads "
                            f"{FORMAT_VERSION}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{path}: no file list")
    for rel in files:  # every file the artifact refers to lies inside it
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise ArtifactError(f"{path}: file {rel!r} lies outside the artifact")
    if verify:
        for rel, entry in files.items():
            f = root / rel
            if not f.is_file():
                raise ArtifactError(f"{f}: missing (listed in {MANIFEST})")
            size = f.stat().st_size
            if size != entry["bytes"]:
                raise ArtifactError(f"{f}: {size} bytes, the manifest says {entry['bytes']} (truncated or "
                                    "replaced)")
            if not (hashed_when_read and hashed_when_read(rel)) and sha256_file(f) != entry["sha256"]:
                raise ArtifactError(f"{f}: checksum mismatch (the file was changed after export)")
        extra = [p.relative_to(root).as_posix() for p in root.rglob("*")
                 if p.is_file() and p.name != MANIFEST and p.relative_to(root).as_posix() not in files]
        if extra:
            raise ArtifactError(f"{root / extra[0]}: not listed in {MANIFEST} (added after export)")
    return manifest


def read_array(root: Path, manifest: dict[str, Any], rel: str, verify: bool = True) -> np.ndarray:
    """The ``.npy`` file ``rel`` of an artifact, read whole into memory and, with ``verify``, checked against
    the manifest's sha256 on the very bytes read. Never memory-mapped: a file truncated or rewritten under a
    running server cannot fault its pages (SIGBUS) or change what it serves; what was checked is what is used."""
    entry = manifest["files"].get(rel)
    f = root / rel
    if entry is None:  # so that it was checked, and lies inside the artifact
        raise ArtifactError(f"{root / MANIFEST}: {rel!r} is not in its file list")
    try:
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            buf = np.empty(size, np.uint8)
            got = fh.readinto(buf.data)
    except OSError as e:
        raise ArtifactError(f"{f}: unreadable ({e})") from e
    if got != size or size != entry["bytes"]:
        raise ArtifactError(f"{f}: {got} bytes read, the manifest says {entry['bytes']} (truncated or "
                            "replaced)")
    if verify and hashlib.sha256(buf.data).hexdigest() != entry["sha256"]:
        raise ArtifactError(f"{f}: checksum mismatch (the file was changed after export)")
    try:  # the array is a view of the checked bytes after the header (which .npy pads to 64 bytes)
        head = io.BytesIO(buf[:min(size, 1 << 16)].tobytes())
        fmt = np.lib.format
        version = fmt.read_magic(head)
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read_header(head)
        if dtype.hasobject or fortran:
            raise ValueError("object or Fortran-ordered arrays are not artifact arrays")
        count = int(np.prod(shape, dtype=np.int64))
        data = buf[head.tell():head.tell() + count * dtype.itemsize]
        return data.view(dtype).reshape(shape)
    except ValueError as e:
        raise ArtifactError(f"{f}: unreadable array ({e})") from e


def list_versions(root: str | Path) -> list[int]:
    """Integer-named artifact versions under a versions directory that hold a manifest, ascending (a
    directory being written is hidden as ``.<n>.tmp-*`` and never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if _VERSION_DIR.match(p.name) and (p / MANIFEST).is_file())


def _fsync_tree(root: Path) -> None:
    """Every file and directory under ``root`` (and root) on disk before the rename publishes them."""
    for p in [*root.rglob("*"), root]:
        fsync_dir(p)


def write_artifact(out: str | Path, fill: Callable[[Path, int], dict[str, Any]]) -> tuple[Path, int]:
    """Write an artifact atomically. ``fill(tmp_dir, version)`` writes the files into ``tmp_dir`` and returns
    the manifest (without ``files``, ``format`` and ``version``, which are added here).

    ``out`` that does not exist: the artifact is ``out`` itself (version 1). ``out`` an existing directory
    without a manifest: a versions directory; the artifact becomes ``out/<newest version + 1>``. An existing
    artifact is never replaced. -> (artifact directory, version)."""
    out = Path(out)
    if (out / MANIFEST).is_file():
        raise ArtifactError(f"--out {out} is an artifact already (give a new directory, or a versions directory "
                            "to write the next version into)")
    versioned = out.is_dir()
    parent = out if versioned else out.parent
    parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):  # another export may take a version number first: take the next
        version = (max(list_versions(out), default=0) + 1) if versioned else 1
        target = out / str(version) if versioned else out
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            manifest = fill(tmp, version)
            manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "version": version, **manifest,
                        "files": file_entries(tmp)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, allow_nan=False) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; serving workers of other users read it
            _fsync_tree(tmp)
            if target.exists():
                raise FileExistsError(target)
            os.rename(tmp, target)  # atomic; fails on a non-empty target (a concurrent export)
        except (FileExistsError, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if versioned and target.exists():
                continue
            if isinstance(e, FileExistsError):
                raise ArtifactError(f"--out {target} exists") from None
            raise disk_error(e, target) from e
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            cause = None if isinstance(e, RecstackError) else os_error_in(e)  # torch.save's "unexpected pos"
            if cause is not None:
                raise disk_error(cause, target) from e
            raise
        fsync_dir(parent)  # the rename itself
        return target, version
    raise ArtifactError(f"{out}: could not take a new version number")

