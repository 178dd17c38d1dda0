"""Reading checkpoint files without trusting them: no code runs, damaged bytes are refused.

Checkpoints travel between people and jobs, so every file of one is read as untrusted input:
  - ``.pt`` files (``ckpt_<step>.pt``, ``state.pt``, ``trainer.pt``, ``rank_<rank>.pt``) are zip archives whose
    every member carries a CRC32: :func:`load_pt` checks them all, then unpickles with ``weights_only=True``
    (tensors and plain Python values only);
  - the files a state file stands beside (tiered table files, DCP shard files and ``.metadata``) are listed in
    that state file, written last, with their size and SHA-256 (:func:`file_digests`, :func:`verify_files`); a
    checkpoint written before the list existed loads unverified, and says so once;
  - DCP's ``.metadata`` is a pickle: :class:`SafeFileSystemReader` reads it with an unpickler that accepts only
    the classes DCP metadata is made of (listed from a real checkpoint's file), for every ``dcp.load``.
Every refusal is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import pickle
import struct
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md

from recstack.errors import CheckpointError

DIGESTS = "file_sha256"  # state-file key: {relative path: {"bytes": size, "sha256": hex digest}}
_CHUNK = 8 << 20

# Every global a DCP ``.metadata`` file of recstack's references (pickletools on a 2-rank checkpoint): the metadata
# dataclasses, the storage index of the file system writer, torch.Size and the dtype / layout / memory-format
# encodings of tensor properties, and the checkpoint path. Constructing any of them runs no user code.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
    for name in ("Metadata", "StorageMeta", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                 "MetadataIndex", "_MEM_FORMAT_ENCODING")
}
_METADATA_GLOBALS.update({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
})


# The classes whose instances a ``.metadata`` file fills in (pickle's BUILD): DCP's dataclasses,
# each from a dict of its own fields, and TensorProperties from its own ``__setstate__`` tuple.
# Nothing else is ever built.
_BUILT_FROM_FIELDS = (dcp_md.Metadata, dcp_md.StorageMeta, dcp_md.TensorStorageMetadata,
                      dcp_md.ChunkStorageMetadata, dcp_md.MetadataIndex, dcp_fs._StorageInfo)
_PLAIN = (str, int, float, bool, type(None), bytes, torch.dtype, torch.layout,
          dcp_md._MEM_FORMAT_ENCODING)


class _MetadataUnpickler(pickle._Unpickler):
    """Python's own unpickler (its opcodes are methods, so BUILD can be replaced; the C one runs
    BUILD itself) that constructs only the listed globals and builds only instances of the DCP
    classes above. A crafted BUILD would otherwise set any attribute of any object it can reach,
    classes included: one that replaced ``pathlib.PosixPath.__fspath__`` changed every path of the
    process before the file was refused."""

    stack: list[Any]  # the unpickler's own, set by ``load``

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_GLOBALS.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)  # a tensor's dtype
        if found is None:
            raise pickle.UnpicklingError(f"it references {module}.{name}, which DCP checkpoint metadata never holds")
        return found

    def load_build(self) -> None:
        state, inst = self.stack.pop(), self.stack[-1]
        kind = type(inst)
        if kind is dcp_md.TensorProperties and isinstance(state, tuple) and len(state) == 5 \
                and all(isinstance(v, _PLAIN) for v in state):
            inst.__setstate__(state)
            return
        if kind in _BUILT_FROM_FIELDS and isinstance(state, dict):
            fields = {f.name for f in dataclasses.fields(kind)}
            unknown = [k for k in state if not isinstance(k, str) or k not in fields]
            if not unknown:
                inst.__dict__.update(state)  # what pickle does for a dataclass, no __setstate__
                return
            raise pickle.UnpicklingError(f"it sets {unknown[0]!r} on a {kind.__name__}, which has "
                                         "no such field")
        what = f"the class {inst.__name__}" if isinstance(inst, type) else f"a {kind.__name__}"
        raise pickle.UnpicklingError(f"it sets attributes of {what}, which DCP checkpoint metadata "
                                     "never does")

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: cast(Any, load_build)}


def read_dcp_metadata(file: Path) -> dcp_md.Metadata:
    """A DCP ``.metadata`` file through the restricted unpickler -> the metadata; CheckpointError naming the
    file when it holds anything else (a crafted pickle is refused before any of it runs)."""
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError,
            KeyError, OverflowError, struct.error) as e:
        raise CheckpointError(f"{file}: refused as DCP checkpoint metadata ({type(e).__name__}: {e})") from e
    except OSError as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from e
    if not isinstance(metadata, dcp_md.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file}: refused as DCP checkpoint metadata (it holds a {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with ``.metadata`` read by :func:`read_dcp_metadata` (torch's own unpickles it
    unrestricted). Tensor data it reads with ``torch.load(weights_only=True)`` already."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if metadata.storage_meta is None:  # as torch's own reader does
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_pt(file: Path, map_location: str | torch.device) -> Any:
    """A ``torch.save`` file -> its object: every zip member's CRC32 checked first (torch does not), then
    unpickled with ``weights_only=True``. CheckpointError naming the file when either fails."""
    try:
        with zipfile.ZipFile(file) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot be loaded (not a complete torch file: {e})") from e
    if bad is not None:
        raise CheckpointError(f"{file}: checksum mismatch in {bad} (the file changed after it was written)")
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only: a class other than tensors and plain values
        lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [""]
        why = next((x for x in lines if "GLOBAL" in x), lines[0])  # torch's line naming the class
        raise CheckpointError(f"{file}: refused: it holds objects other than tensors and plain values "
                              f"({why})") from e
    except Exception as e:  # a bad record, a storage of the wrong size: not usable
        raise CheckpointError(f"{file}: cannot be loaded ({type(e).__name__}: {e})") from e


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digests(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes", "sha256"}} of the files ``names`` under ``directory``, for a state file."""
    return {n: {"bytes": (directory / n).stat().st_size, "sha256": _sha256(directory / n)} for n in sorted(names)}


def verify_files(directory: Path, digests: dict[str, Any], names: Iterable[str] | None = None) -> None:
    """Check the files ``names`` (default all) of ``digests`` under ``directory``: present, of the size and
    SHA-256 recorded. CheckpointError naming the first that is not."""
    for name in sorted(digests) if names is None else names:
        want, file = digests[name], directory / name
        if not isinstance(want, dict) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{directory}: malformed checksum entry {name!r}")
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the checkpoint")
        size = file.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(f"{file}: {size} bytes, the checkpoint recorded {want.get('bytes')} "
                                  "(truncated or changed after it was written)")
        if _sha256(file) != want.get("sha256"):
            raise CheckpointError(f"{file}: checksum mismatch (the file changed after it was written)")


_told_unverified = False


def note_unverified(path: Path) -> None:
    """Say once per process that a checkpoint without checksums (written by an older recstack) loads unverified."""
    global _told_unverified
    if not _told_unverified:
        _told_unverified = True
        print(f"note: {path} records no checksums of its files (written by an older recstack): loading it "
              "unverified", file=sys.stderr)
