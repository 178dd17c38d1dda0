"""Hostile inputs end in one line, as real ``recstack`` processes: the error names the file (and
line) or the config key, the exit code is 2, there is no traceback and nothing is left
half-written. Damaged gzip and CSV files, configs, ``meta.json`` and plan table files nested
100,000 deep or not UTF-8, ``meta.json`` entries of the wrong type or naming a file outside the
set, an absurd MLP width; and a ``checkpoint_every`` that cannot be honoured is said, not
silently dropped."""

from __future__ import annotations

import gzip
import json
import random
import shutil
from pathlib import Path

import pytest
from conftest import SMALL, run_cli, set_options, train_args

REPO = Path(__file__).resolve().parent.parent
CRITEO_CSV = REPO / "configs" / "schemas" / "criteo_csv.toml"
FRAPPE = REPO / "configs" / "schemas" / "frappe_libfm.toml"
END = 120  # seconds any process here gets to end: a bound on hangs, not a performance figure
HEADER = ",".join(["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))])
ROWS = "".join(
    f"{i % 2},"
    + ",".join(["0.5"] * 13)
    + ","
    + ",".join(f"{i * j % 99:08x}" for j in range(26))
    + "\n"
    for i in range(2000)
)
DEEP = 100_000


def one_line(args: list[str], code: int = 2) -> str:
    """``recstack ARGS`` must fail with ``code``, no traceback, one error line -> that line."""
    res = run_cli(args, timeout=END)
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr[
        -3000:
    ]
    errors = [line for line in res.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, res.stderr[-3000:]
    return errors[0]


def prepare_csv(raw: Path, out: Path) -> list[str]:
    """The arguments of ``recstack data prepare`` of the Criteo CSV file ``raw`` into ``out``."""
    return ["data", "prepare", "--schema", str(CRITEO_CSV), str(raw), "--out", str(out),
            "--no-progress"]


def corrupt_gzip(path: Path, text: str) -> Path:
    """``text`` gzipped with bytes of the deflate stream flipped near its start (zlib.error on the
    first read)."""
    packed = bytearray(gzip.compress(text.encode()))
    for i in range(100, 160):
        packed[i] ^= 0x33
    path.write_bytes(bytes(packed))
    return path


@pytest.mark.parametrize("command", ["prepare", "inspect"])
def test_a_corrupt_gzip_file_names_the_file(command: str, tmp_path: Path) -> None:
    raw = corrupt_gzip(tmp_path / "train.csv.gz", HEADER + "\n" + ROWS)
    out = tmp_path / "out"
    args = prepare_csv(raw, out) if command == "prepare" else ["data", "inspect", str(raw)]
    line = one_line(args)
    assert f"{raw}: corrupt or truncated gzip data" in line, line
    assert not out.exists() and not out.with_name("out.tmp").exists()


def test_a_corrupt_gzip_libfm_file_names_the_file_in_inspect(tmp_path: Path) -> None:
    text = "".join(f"{i % 2} {i % 7}:1 {10 + i % 5}:1\n" for i in range(20000))
    raw = corrupt_gzip(tmp_path / "train.libfm.gz", text)
    assert f"{raw}: corrupt or truncated gzip data" in one_line(["data", "inspect", str(raw)])


@pytest.mark.parametrize("damage", ["random bytes", "a carriage return in the header"])
def test_random_bytes_in_a_csv_file_name_the_file(damage: str, tmp_path: Path) -> None:
    raw = tmp_path / "train.csv"
    if damage == "random bytes":  # rows of the wrong field count that are not UTF-8 either
        rng = random.Random(0)
        raw.write_bytes((HEADER + "\n").encode() + bytes(rng.randrange(256) for _ in range(5000)))
    else:  # the csv module refuses a line break inside an unquoted field (_csv.Error)
        raw.write_bytes(b"label,I1\rX,C1\n1,2,3\n")
    out = tmp_path / "out"
    line = one_line(prepare_csv(raw, out))
    assert f"{raw}:" in line, line
    assert (
        ("not UTF-8 text" in line)
        if damage == "random bytes"
        else ("cannot parse the first line" in line)
    ), line
    assert not out.exists() and not out.with_name("out.tmp").exists()


@pytest.mark.parametrize("damage", ["nested", "not UTF-8"])
def test_a_damaged_config_file_names_the_file(
    damage: str, tiny_dataset: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.toml"
    if damage == "nested":  # tomllib recurses once per level: a RecursionError
        config.write_text("[train]\nx = " + "[" * DEEP + "]" * DEEP + "\n")
    else:
        config.write_bytes(b"[train]\nmax_steps = 3\n# caf\xe9 (Latin-1)\n")
    line = one_line(["train", "--config", str(config), "--output-dir", str(tmp_path / "run")])
    want = (
        f"{config}: invalid TOML: nested too deeply"
        if damage == "nested"
        else f"{config}:3: not UTF-8 text"
    )
    assert want in line, line
    assert not (tmp_path / "run").exists()


def test_an_override_nested_too_deeply_names_it(tmp_path: Path) -> None:
    deep = 60_000  # as deep as one argument may be (128 KiB)
    line = one_line(["train", "--set", "model.top_mlp=" + "[" * deep + "]" * deep])
    assert "override model.top_mlp: the value is nested too deeply" in line, line


def _copy(data: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    return copy


@pytest.mark.parametrize(
    "damage",
    ["nested", "not UTF-8", "num_embeddings a string", "labels outside", "labels absolute"],
)
def test_a_damaged_meta_json_names_the_file_and_key(
    damage: str, tiny_dataset: Path, tmp_path: Path
) -> None:
    data = _copy(tiny_dataset, tmp_path)
    meta_file = data / "meta.json"
    meta = json.loads(meta_file.read_text())
    want = {
        "nested": f"{meta_file}: invalid JSON (nested too deeply)",
        "not UTF-8": f"{meta_file}:1: not UTF-8 text",
        "num_embeddings a string": "sparse feature 'C1': num_embeddings must be a JSON integer, "
        "got str '50'",
        "labels outside": "arrays.labels.file '../outside.bin' is not a file of this prepared set",
        "labels absolute": "is not a file of this prepared set",
    }[damage]
    if damage == "nested":
        meta_file.write_text("[" * DEEP + "]" * DEEP)
    elif damage == "not UTF-8":
        meta_file.write_bytes(b"\xff" + meta_file.read_bytes())
    elif damage == "num_embeddings a string":
        meta["sparse_features"][0]["num_embeddings"] = "50"
        meta_file.write_text(json.dumps(meta))
    else:  # a labels file of the right size outside the set: read (later deleted with it) before
        outside = tmp_path / "outside.bin"
        shutil.copy(data / "labels.bin", outside)
        meta["arrays"]["labels"]["file"] = (
            "../outside.bin" if damage == "labels outside" else str(outside)
        )
        meta_file.write_text(json.dumps(meta))
    line = one_line(train_args(tmp_path / "run", data, [*SMALL, "train.max_steps=1"]))
    assert want in line and str(meta_file) in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_absurd_mlp_width_is_an_error_before_allocating(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    """10^8 units ended in an allocator error (a traceback naming neither key nor size)."""
    line = one_line(
        train_args(
            tmp_path / "run",
            tiny_dataset,
            [*SMALL, "model.top_mlp=[100000000, 1]", "train.batch_size=4096"],
        )
    )
    assert (
        "model.top_mlp: layer 1 of 100,000,000 units needs" in line and "of memory on cpu" in line
    ), line


def test_checkpoint_every_without_an_output_dir_is_said(tiny_dataset: Path) -> None:
    """Not an error (configs written for real runs are tried without an output directory), but
    said at once: the checkpoints asked for are not written."""
    options = [
        f'data.train="{tiny_dataset}"',
        *SMALL,
        "train.max_steps=2",
        "train.checkpoint_every=1",
    ]
    res = run_cli(["train", *set_options(options)], timeout=END)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "recstack train: warning: train.checkpoint_every=1 but no --output-dir: no checkpoint "
        "(nor metrics.jsonl or summary.json) is saved"
    ) in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("damage", ["nested", "not UTF-8"])
def test_a_damaged_table_file_for_plan_names_the_file(damage: str, tmp_path: Path) -> None:
    tables = tmp_path / "tables.json"
    if damage == "nested":
        tables.write_text("[" * DEEP + "]" * DEEP)
    else:
        tables.write_bytes(b'[{"name": "caf\xe9", "rows": 10, "dim": 4}]')
    line = one_line(["plan", "--tables", str(tables), "--dim", "4"])
    want = "not valid JSON: nested too deeply" if damage == "nested" else ":1: not UTF-8 text"
    assert f"{tables}" in line and want in line, line
