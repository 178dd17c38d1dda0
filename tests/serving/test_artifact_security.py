"""No code runs from a serving artifact: a ``dense.pt2`` program archive with an entry that ``torch.export.load``
would unpickle (pickled sample inputs, a weight stored pickled) and a table ``.npy`` holding an object array are
refused by ``recstack serve`` with one line naming the file, and the command in them never runs.

The attacker is taken to be thorough: the manifest's sha256 and size of the crafted file are recomputed, so the
checksum check passes and the artifact's own readers (``check_program_pickle_free``, ``np.load`` with
``allow_pickle=False``) are what stop it. Each crafted ``.pt2`` does run its command when handed to
``torch.export.load`` unchecked (torch 2.13): that is what the check in front of it is for."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CHECKPOINT_STEPS, Payload, free_port, run_cli, train_steps

from recstack.serving.artifact import MANIFEST, read_manifest, sha256_file
from recstack.serving.export import export_checkpoint

END = 120  # seconds a refused `recstack serve` gets to end: a bound on hangs, not a performance figure


def torch_bytes(obj: object) -> bytes:
    """``obj`` as ``torch.save`` writes it (a zip holding a pickle)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def rewrite_zip(path: Path, change: Callable[[str, bytes], bytes]) -> None:
    """Rewrite the zip archive ``path`` with each record's bytes replaced by ``change(name, bytes)``."""
    with zipfile.ZipFile(path) as src:
        records = [(info, change(info.filename, src.read(info))) for info in src.infolist()]
    with zipfile.ZipFile(path, "w") as dst:
        for info, data in records:
            dst.writestr(info, data)


def pickled_sample_inputs(program: Path, marker: Path) -> str:
    """The sample-inputs record (empty as ``recstack export`` writes it) replaced by a torch file whose pickle
    runs the command: ``torch.export.load`` tries ``weights_only=True``, then falls back to an unrestricted
    ``torch.load``. -> the refusal expected."""
    rewrite_zip(program, lambda name, data: torch_bytes((Payload(marker),)) if "/data/sample_inputs/" in name
                else data)
    return "holds pickled sample inputs"


def pickled_weight(program: Path, marker: Path) -> str:
    """The first weight's record replaced by a torch file whose pickle runs the command, and marked
    ``use_pickle`` in the weights' config: ``torch.export.load`` reads it with ``torch.load(weights_only=False)``.
    -> the refusal expected."""
    with zipfile.ZipFile(program) as z:
        config_name = next(n for n in z.namelist() if n.endswith("/data/weights/model_weights_config.json"))
        config = json.loads(z.read(config_name))
    key = next(iter(config["config"]))
    entry = config["config"][key]
    entry["use_pickle"] = True
    record = config_name.rsplit("/", 1)[0] + "/" + entry["path_name"]

    def change(name: str, data: bytes) -> bytes:
        if name == config_name:
            return json.dumps(config).encode()
        return torch_bytes(Payload(marker)) if name == record else data

    rewrite_zip(program, change)
    return f"{key!r} is a pickled object"


def object_array_table(table: Path, marker: Path) -> str:
    """A table ``.npy`` that holds an object array (a pickle that runs the command when loaded with
    ``allow_pickle=True``). -> the refusal expected."""
    np.save(table, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    return "unreadable array"


def reseal(artifact: Path, file: Path) -> None:
    """Record the crafted ``file``'s sha256 and size in the manifest, as an attacker who can write the artifact
    would: the checksum check then passes."""
    manifest = json.loads((artifact / MANIFEST).read_text())
    manifest["files"][file.relative_to(artifact).as_posix()] = {"sha256": sha256_file(file),
                                                                "bytes": file.stat().st_size}
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


@pytest.fixture(scope="module")
def tiny_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short single-process run whose checkpoint the artifacts are exported from."""
    run = tmp_path_factory.mktemp("artifact_security") / "run"
    train_steps(tiny_dataset, run, CHECKPOINT_STEPS)
    return run


@pytest.mark.parametrize("craft", [pickled_sample_inputs, pickled_weight, object_array_table],
                         ids=["pt2-sample-inputs", "pt2-pickled-weight", "npy-object-array"])
def test_a_crafted_artifact_file_runs_nothing_in_recstack_serve(tiny_run: Path, tmp_path: Path,
                                                                craft: Callable[[Path, Path], str]) -> None:
    """``recstack serve`` on an artifact with one crafted file (checksums recomputed): exit 2, one line naming
    the file and why it is refused, no traceback, the command never run, the port never opened."""
    artifact, _ = export_checkpoint(tiny_run, tmp_path / "model")
    manifest = json.loads((artifact / MANIFEST).read_text())
    file = artifact / (manifest["table_files"]["fp32"]["data"] if craft is object_array_table
                       else manifest["dense_program"]["file"])
    marker = tmp_path / "pwned"
    refusal = craft(file, marker)
    reseal(artifact, file)
    read_manifest(artifact, verify=True)  # every checksum matches: the readers themselves must refuse it
    res = run_cli(["serve", str(artifact), "--port", str(free_port())], timeout=END)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "recstack serve: error: " in line]
    assert len(errors) == 1, res.stderr[-3000:]
    assert f"recstack serve: error: {file}: {refusal}" in errors[0], errors[0]
    assert not marker.exists()
