"""Bounded fuzz of every reader of user input (libFM, CSV/TSV, Parquet, Criteo TSV, a prepared
set's ``meta.json``) and of the config loader: whatever the bytes, the result is a report, a
prepared set or a config, or one of recstack's own errors (a :class:`RecstackError`, printed as
one line by the command line); never another exception (a traceback).

Inputs are valid samples with bytes flipped, inserted, cut and (half of the time) gzipped, plus
raw random bytes. Examples are drawn deterministically (``derandomize``) and bounded so that the
whole module runs in well under a minute; ``RECSTACK_FUZZ_EXAMPLES=N`` runs N examples per target
instead (a longer search, by hand). ``pytest -s`` prints how many ran and how they ended."""

from __future__ import annotations

import gzip
import io
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_tiny_dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recstack.config import Config, load_config
from recstack.data.prepare.criteo_prepare import prepare_criteo
from recstack.data.prepare.inspect import inspect_file
from recstack.data.prepare.schema import SourceSpec, load_schema
from recstack.data.prepare.schema_prepare import prepare_dataset
from recstack.data.prepared_dataset import PreparedDataset
from recstack.errors import RecstackError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("RECSTACK_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)


def _libfm() -> bytes:
    return b"".join(
        f"{i % 2 * 2 - 1} {i % 7}:1 {10 + i % 5}:1 {20 + i % 3}:0.5\n".encode() for i in range(40)
    )


def _csv(sep: str) -> bytes:
    rows = [sep.join(["label", "I1", "C1", "C2"])]
    rows += [
        sep.join(
            [str(i % 2), f"{i * 0.37:.2f}", f"u{i % 9}", f'"x,{i % 4}"' if sep == "," else f"x{i}"]
        )
        for i in range(40)
    ]
    return ("\n".join(rows) + "\n").encode()


def _criteo() -> bytes:
    return b"".join(
        (
            "\t".join(
                [
                    str(i % 2),
                    *(str(i % 50 + j) for j in range(13)),
                    *(f"{(i * 31 + j) % 97:08x}" for j in range(26)),
                ]
            )
            + "\n"
        ).encode()
        for i in range(30)
    )


def _parquet() -> bytes:
    table = pa.table(
        {
            "label": [i % 2 for i in range(40)],
            "x": [i * 0.5 for i in range(40)],
            "item": [f"i{i % 6}" for i in range(40)],
            "tags": [[i % 3, i % 5] for i in range(40)],
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


SAMPLES = {
    "libfm": _libfm(),
    "csv": _csv(","),
    "tsv": _csv("\t"),
    "criteo": _criteo(),
    "parquet": _parquet(),
}
CSV_SCHEMA = """[source]
format = "{fmt}"
[label]
column = "label"
[[dense]]
name = "I1"
[[sparse]]
name = "C1"
[[sparse]]
name = "C2"
"""


@st.composite
def damaged(draw: st.DrawFn, sample: bytes) -> bytes:
    """``sample`` with a few edits (a byte set, bytes inserted, the end cut), gzipped half of the
    time, or random bytes (a tenth of the time)."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=400))
    data = bytearray(sample)
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        kind = draw(st.sampled_from(["set", "insert", "cut"]))
        if kind == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:]
    if draw(st.booleans()):
        packed = bytearray(gzip.compress(bytes(data)))
        if draw(st.booleans()) and len(packed) > 12:  # damage the compressed stream itself
            at = draw(st.integers(10, len(packed) - 1))
            packed[at] ^= draw(st.integers(1, 255))
        data = packed
    return bytes(data)


RAN: Counter[str] = (
    Counter()
)  # examples run per outcome, for the summary printed at the end (pytest -s)


def outcome(call: Callable[[], Any]) -> None:
    """``call()`` gives a result or raises a one-line RecstackError; anything else fails."""
    try:
        call()
    except RecstackError as e:
        RAN["one-line error" if "\n" not in str(e).strip() else "other"] += 1
        assert "\n" not in str(e).strip(), str(e)
    except Exception:
        RAN["other"] += 1
        raise
    else:
        RAN["result"] += 1


def survives(run: Callable[[Path], Any], data: bytes, name: str) -> None:
    """``run`` on a file holding ``data``: a result, or a one-line RecstackError."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        outcome(lambda: run(path))


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    print(
        f"\nreader fuzz: {sum(RAN.values())} examples, {RAN['result']} results, "
        f"{RAN['one-line error']} one-line errors, {RAN['other']} other outcomes (tracebacks or "
        "multi-line errors)"
    )


def _inspect(fmt: str) -> Callable[[Path], Any]:
    return lambda path: inspect_file([path], SourceSpec(format=fmt))


def _prepare(schema_text: str) -> Callable[[Path], Any]:
    def run(path: Path) -> None:
        schema_file = path.with_name("schema.toml")
        schema_file.write_text(schema_text)
        prepare_dataset(load_schema(schema_file), [path], path.with_name("out"), progress=False)

    return run


LIBFM_SCHEMA = """[source]
format = "libfm"
fields = ["user", "item", "tag"]
[label]
column = "label"
threshold = 0.0
[[sparse]]
name = "user"
[[sparse]]
name = "item"
[[dense]]
name = "tag"
column = "tag#value"
"""


@pytest.mark.parametrize("fmt", ["libfm", "csv", "tsv", "parquet"])
def test_inspect_any_bytes(fmt: str) -> None:
    @FUZZ
    @given(damaged(SAMPLES[fmt]))
    def check(data: bytes) -> None:
        survives(_inspect(fmt), data, f"in.{fmt}")

    check()


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_prepare_csv_any_bytes(fmt: str) -> None:
    @FUZZ
    @given(damaged(SAMPLES[fmt]))
    def check(data: bytes) -> None:
        survives(_prepare(CSV_SCHEMA.format(fmt=fmt)), data, f"in.{fmt}")

    check()


def test_prepare_libfm_any_bytes() -> None:
    @FUZZ
    @given(damaged(SAMPLES["libfm"]))
    def check(data: bytes) -> None:
        survives(_prepare(LIBFM_SCHEMA), data, "in.libfm")

    check()


def test_prepare_criteo_any_bytes() -> None:
    @FUZZ
    @given(damaged(SAMPLES["criteo"]), st.booleans())
    def check(data: bytes, vocab: bool) -> None:
        options = {"vocab_min_freq": 1} if vocab else {"max_ind_range": 1000}
        survives(
            lambda p: prepare_criteo([p], p.with_name("out"), progress=False, **options),
            data,
            "day_0",
        )

    check()


def _config_sample() -> bytes:
    return (
        b'[model]\nembedding_dim = 8\nbottom_mlp = [16, 8]\n[train]\nbatch_size = 64\nlr = 0.1\n'
        b'[data.synth]\nrows = 100\n'
    )


def test_config_any_bytes() -> None:
    @FUZZ
    @given(damaged(_config_sample()))
    def check(data: bytes) -> None:
        survives(load_config, data, "config.toml")

    check()


toml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def test_config_any_values() -> None:
    """Every key of every section with values of any type, as ``--set`` overrides (JSON literals:
    those TOML does not share, such as objects and null, arrive as strings)."""
    keys = [f"{s}.{k}" for s, sec in Config().to_dict().items() for k in sec]

    @FUZZ
    @given(st.lists(st.tuples(st.sampled_from(keys), toml_values), min_size=1, max_size=3))
    def check(sets: list[tuple[str, Any]]) -> None:
        outcome(lambda: load_config(None, [f"{k}={json.dumps(v)}" for k, v in sets]))

    check()


def test_meta_json_any_bytes(tmp_path: Path) -> None:
    """A prepared set whose ``meta.json`` is damaged: opened, or refused in one line."""
    base = write_tiny_dataset(tmp_path / "data", rows=50)
    meta = (base / "meta.json").read_bytes()

    @FUZZ
    @given(damaged(meta))
    def check(data: bytes) -> None:
        (base / "meta.json").write_bytes(data)
        outcome(lambda: PreparedDataset(base))

    check()
