"""The data a run trains and evaluates on: an eval set must match the training layout (and a checkpoint's
model), [data.synth] regenerates when its options change, and a run without evaluation rows trains without
evaluation and writes valid JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import small_config, train_args

from recstack.cli.main import main
from recstack.data.format import SparseFeatureSpec
from recstack.data.prepared_writer import PreparedWriter
from recstack.training.trainer import Trainer

SMALL = [
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.batch_size=64",
    "train.threads=1",
    "train.progress=false",
    'train.device="cpu"',
]


def _write(path: Path, rows: int, sizes: list[int], dense: int = 3, names: list[str] | None = None,
           tables: list[str] | None = None) -> Path:
    """A prepared set with a learnable label: the first dense feature and the first sparse id decide."""
    rng = np.random.default_rng(len(str(path)))
    x = rng.random((rows, dense)).astype(np.float32)
    ids = np.stack([rng.integers(0, n, rows) for n in sizes], 1) if rows else np.zeros((0, len(sizes)), np.int64)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-(3 * x[:, 0] - 1.5)))).astype(np.float32)
    names = names or [f"C{i + 1}" for i in range(len(sizes))]
    tables = tables or [""] * len(sizes)
    specs = [SparseFeatureSpec(n, s, table=t) for n, s, t in zip(names, sizes, tables, strict=True)]
    with PreparedWriter(path, [f"I{i + 1}" for i in range(dense)], specs) as w:
        w.write(labels, x, ids)
    return path


def _cfg(train: Path | None, extra: list[str] = ()):
    return small_config(train, extra, base=SMALL)


def test_eval_data_with_another_layout_fails_at_start_up(tmp_path: Path) -> None:
    train = _write(tmp_path / "train", 2000, [20, 30, 5])
    cases = {
        "sizes": (_write(tmp_path / "sizes", 500, [20, 31, 5]), r"sparse feature #2 \('C2'\): table size 30 vs 31"),
        "sparse": (_write(tmp_path / "sparse", 500, [20, 30]), r"3 vs 2 sparse features, the first that differs is "
                                                                r"#3: 'C3' vs none"),
        "dense": (_write(tmp_path / "dense", 500, [20, 30, 5], dense=2), r"3 vs 2 dense features, the first that "
                                                                           r"differs is #3: 'I3' vs none"),
        "names": (_write(tmp_path / "names", 500, [20, 30, 5], names=["C1", "X", "C3"]),
                  r"sparse feature #2 \('C2'\): name 'C2' vs 'X'"),
        "tables": (_write(tmp_path / "tables", 500, [20, 20, 5], tables=["", "C1", ""]),
                   r"sparse feature #2 \('C2'\): table 'C2' vs 'C1'"),
    }
    for path, match in cases.values():
        with pytest.raises(ValueError, match=rf"data\.eval {path} was prepared with a different layout than "
                                             rf"data\.train {train}: {match}"):
            Trainer(_cfg(train, [f'data.eval="{path}"']))
    same = _write(tmp_path / "same", 500, [20, 30, 5])
    assert Trainer(_cfg(train, [f'data.eval="{same}"'])).eval_loader.end == 500


def test_eval_and_predict_check_the_data_against_the_checkpoint(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    train = _write(tmp_path / "train", 2000, [20, 30, 5])
    Trainer(_cfg(train, ["train.max_steps=5"]), tmp_path / "run").train()
    other = _write(tmp_path / "other", 300, [20, 31, 5])
    for cmd in (["eval"], ["predict", "--out", str(tmp_path / "p.npy")]):
        assert main([*cmd, "--checkpoint", str(tmp_path / "run"), "--data", str(other)]) == 2
        err = capsys.readouterr().err
        assert (f"{other}: sparse feature #2 ('C2') has a table of 31 rows, the model's (trained on {train}) has "
                "30") in err
    shared = _write(tmp_path / "shared", 300, [20, 20, 5], tables=["", "C1", ""])
    same = _write(tmp_path / "same", 300, [20, 30, 5])
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(shared)]) == 2
    assert "sparse feature #2 ('C2') has a table of 20 rows" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(same)]) == 0
    # tables shared differently with the same sizes
    Trainer(_cfg(shared, ["train.max_steps=5"]), tmp_path / "run_shared").train()
    apart = _write(tmp_path / "apart", 300, [20, 20, 5])
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run_shared"), "--data", str(apart)]) == 2
    assert "sparse feature #2 ('C2') looks up table 'C2', which does not match" in capsys.readouterr().err


SYNTH = "data.synth={rows=600, seed=0, max_table_size=40, calibration_rows=500}"


def test_synth_data_is_generated_again_when_its_options_change(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    meta = tmp_path / "data" / "meta.json"
    Trainer(_cfg(None, [SYNTH]), tmp_path)
    first = json.loads(meta.read_text())
    assert first["num_rows"] == 600 and first["info"]["config"]["seed"] == 0
    stamp = meta.stat().st_mtime_ns
    capsys.readouterr()
    Trainer(_cfg(None, [SYNTH]), tmp_path)  # the same options: reused
    assert meta.stat().st_mtime_ns == stamp and "generating it again" not in capsys.readouterr().err
    Trainer(_cfg(None, [SYNTH, "data.synth.rows=900", "data.synth.seed=5"]), tmp_path)
    assert f"{tmp_path / 'data'}: generated with other [data.synth] options (rows, seed differ); generating it " \
           "again" in capsys.readouterr().err
    again = json.loads(meta.read_text())
    assert again["num_rows"] == 900 and again["info"]["config"]["seed"] == 5
    # a prepared set that the generator did not write is never overwritten
    mine = _write(tmp_path / "mine", 300, [20, 30, 5])
    with pytest.raises(ValueError, match=r"holds a data set that \[data.synth\] did not generate"):
        Trainer(_cfg(mine, [SYNTH]))
    assert json.loads((mine / "meta.json").read_text())["num_rows"] == 300


def _strict_json(text: str) -> dict:
    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constant)


def test_no_evaluation_rows_trains_without_evaluation(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    train = _write(tmp_path / "train", 2000, [20, 30, 5])
    s = Trainer(_cfg(train, ["train.max_steps=10", "train.eval_every=5", "data.eval_fraction=0.0"]),
                tmp_path / "a").train()
    assert "no evaluation: data.eval_fraction=0 of 2000 training rows holds no row" in capsys.readouterr().err
    summary = _strict_json((tmp_path / "a" / "summary.json").read_text())
    assert summary == s
    assert "auc" not in summary and summary["eval_examples"] == 0 and summary["steps"] == 10
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert {x["kind"] for x in lines} == {"train"}
    # an empty eval set, from the command line
    empty = _write(tmp_path / "empty", 0, [20, 30, 5])
    args = train_args(tmp_path / "b", train, [f'data.eval="{empty}"', "train.max_steps=4", *SMALL])
    assert main(args) == 0
    out = capsys.readouterr()
    assert f"no evaluation: data.eval {empty} has no rows" in out.err and "final eval: none" in out.out
    assert "auc" not in _strict_json((tmp_path / "b" / "summary.json").read_text())
    # evaluation required: an error before training
    with pytest.raises(ValueError, match=r"train.target_auc=0.7 needs evaluation rows, but data.eval_fraction=0"):
        Trainer(_cfg(train, ["data.eval_fraction=0.0", "train.eval_every=5", "train.target_auc=0.7"]))


def test_undefined_metrics_are_null_in_summary_json(tmp_path: Path) -> None:
    train = _write(tmp_path / "train", 2000, [20, 30, 5])
    one_class = tmp_path / "one_class"
    specs = [SparseFeatureSpec(f"C{i + 1}", n) for i, n in enumerate([20, 30, 5])]
    with PreparedWriter(one_class, ["I1", "I2", "I3"], specs) as w:  # only negatives: AUC is undefined
        w.write(np.zeros(100, np.float32), np.zeros((100, 3), np.float32), np.zeros((100, 3), np.int64))
    s = Trainer(_cfg(train, ["train.max_steps=4", f'data.eval="{one_class}"']), tmp_path / "run").train()
    assert math.isnan(s["auc"])
    summary = _strict_json((tmp_path / "run" / "summary.json").read_text())
    assert summary["auc"] is None and summary["eval_examples"] == 100


def test_a_last_batch_of_one_row_with_batch_norm_is_refused(tmp_path: Path) -> None:
    """129 training rows in batches of 64 end with one row, on which batch normalisation cannot train: an error
    naming the options instead of a failure at the end of the first epoch; with train.drop_last it trains."""
    from conftest import SMALL, write_tiny_dataset

    from recstack.config import load_config
    from recstack.errors import ConfigError

    data = write_tiny_dataset(tmp_path / "d", rows=129)
    opts = [f'data.train="{data}"', *SMALL, "data.eval_fraction=0", 'model.mlp_norm="batch"']
    with pytest.raises(ConfigError, match="train.drop_last = true"):
        Trainer(load_config(None, opts), tmp_path / "a")
    summary = Trainer(load_config(None, [*opts, "train.drop_last=true"]), tmp_path / "b").train()
    assert summary["steps"] == 2 and summary["train_samples"] == 128
