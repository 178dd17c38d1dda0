"""End-to-end training: determinism, SIGKILL + resume, eval/predict, config errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, SMALL, kill_after_checkpoints, run_cli, small_config, train_args, train_steps

from recstack.cli.main import main
from recstack.config import load_config
from recstack.data.loader import LoaderPosition
from recstack.errors import ConfigError
from recstack.training.checkpoint.single import list_checkpoints
from recstack.training.trainer import Trainer

METRICS = ("auc", "logloss", "ne", "calibration", "accuracy", "steps", "train_samples")


def test_same_seed_same_result(tiny_dataset: Path) -> None:
    a = train_steps(tiny_dataset, None, ["train.max_steps=40"])
    b = train_steps(tiny_dataset, None, ["train.max_steps=40"])
    c = train_steps(tiny_dataset, None, ["train.max_steps=40", "train.seed=1"])
    assert all(a[k] == b[k] for k in METRICS)
    assert a["logloss"] != c["logloss"]


def test_learns_and_writes_outputs(tiny_dataset: Path, tmp_path: Path) -> None:
    s = train_steps(tiny_dataset, tmp_path, ["train.epochs=2", "train.eval_every=200", "train.log_every=50"])
    # the fixture stores its true click probabilities, so the best possible AUC is known
    assert s["auc"] - 0.5 >= 0.9 * (s["oracle_auc"] - 0.5)
    for name in ("metrics.jsonl", "summary.json", "curves.png", "config.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").rglob("*"))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {x["kind"] for x in lines} == {"train", "eval"}
    assert json.loads((tmp_path / "summary.json").read_text())["auc"] == s["auc"]


def test_target_auc_stops_at_the_first_evaluation_that_reaches_it(tiny_dataset: Path, tmp_path: Path) -> None:
    common = ["train.max_steps=200", "train.eval_every=20"]
    train_steps(tiny_dataset, tmp_path / "free", common)
    lines = [json.loads(x) for x in (tmp_path / "free" / "metrics.jsonl").read_text().splitlines()]
    periodic = [x for x in lines if x["kind"] == "eval" and x["step"] < 200]
    target = max(x["auc"] for x in periodic[:4])  # reached first at that evaluation (runs are deterministic)
    first = next(x for x in periodic if x["auc"] >= target)
    s = train_steps(tiny_dataset, tmp_path / "target", [*common, f"train.target_auc={target!r}"])
    assert s["target_reached_step"] == s["steps"] == first["step"] < 200
    assert s["auc"] == first["auc"] and s["target_auc"] == target
    evals = [json.loads(x) for x in (tmp_path / "target" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in evals if x["kind"] == "eval"][-1] == first["step"]  # not evaluated twice
    cfg = small_config(tiny_dataset, [*common, f"train.target_auc={target!r}"])
    again = Trainer(cfg, tmp_path / "target", resume=True)  # a finished run stays finished
    assert again.step == first["step"]
    done = again.train()
    assert done["steps"] == done["target_reached_step"] == first["step"]
    never = train_steps(tiny_dataset, None, [*common, "train.target_auc=0.9999"])
    assert never["steps"] == 200 and never["target_reached_step"] is None
    with pytest.raises(ConfigError, match="train.target_auc: needs train.eval_every"):
        load_config(None, ["train.target_auc=0.8"])
    with pytest.raises(ConfigError, match=r"train.target_auc: must be in \[0, 1\)"):
        load_config(None, ["train.target_auc=1.5", "train.eval_every=10"])

def test_sigkill_then_resume_matches_uninterrupted(tiny_dataset: Path, tmp_path: Path) -> None:
    extra = ["train.epochs=2", "train.checkpoint_every=50", "train.eval_every=300", "train.shuffle=true"]
    ref = run_cli(train_args(tmp_path / "ref", tiny_dataset, [*SMALL, *extra]))
    assert ref.returncode == 0, ref.stderr

    killed = kill_after_checkpoints(train_args(tmp_path / "run", tiny_dataset, [*SMALL, *extra]),
                                    tmp_path / "run" / "checkpoints", 2)
    assert killed.returncode == -signal.SIGKILL, "training finished before it could be killed"
    assert not (tmp_path / "run" / "summary.json").exists()

    resumed = run_cli(train_args(tmp_path / "run", tiny_dataset, [*SMALL, *extra], "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: continuing from" in resumed.stdout
    a = json.loads((tmp_path / "ref" / "summary.json").read_text())
    b = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {k: a[k] for k in METRICS} == {k: b[k] for k in METRICS}


def test_corrupt_newest_checkpoint_is_skipped(tiny_dataset: Path, tmp_path: Path) -> None:
    train_steps(tiny_dataset, tmp_path, ["train.max_steps=30", "train.checkpoint_every=10"])
    ckpts = list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == ["ckpt_000000010.pt", "ckpt_000000020.pt", "ckpt_000000030.pt"]
    ckpts[-1].write_bytes(ckpts[-1].read_bytes()[:1000])  # torn write
    cfg = small_config(tiny_dataset, ["train.max_steps=30"])
    with pytest.warns(UserWarning, match="cannot be loaded"):
        t = Trainer(cfg, tmp_path, resume=True)
    assert t.step == 20


def test_pruning_keeps_the_checkpoint_just_written(tmp_path: Path) -> None:
    """A run resumed from an older checkpoint (the newest did not load) writes steps below a stale one; with
    train.keep_checkpoints the new checkpoints must stay and the stale one go, not the other way round."""
    from recstack.training.checkpoint.single import latest_checkpoint, save_checkpoint

    for step in (10, 20):
        save_checkpoint(tmp_path, step, {"x": step}, keep=1)
    stale = save_checkpoint(tmp_path, 30, {"x": 30}, keep=1)
    stale.write_bytes(stale.read_bytes()[:100])  # torn: a resume continues from step 20 ...
    assert [p.name for p in list_checkpoints(tmp_path)] == [stale.name]  # (keep=1: 20 is gone, it restarts)
    written = save_checkpoint(tmp_path, 10, {"x": 10}, keep=1)
    assert list_checkpoints(tmp_path) == [written]
    assert latest_checkpoint(tmp_path)["x"] == 10
    save_checkpoint(tmp_path, 20, {"x": 20}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_000000010.pt", "ckpt_000000020.pt"]


def test_a_fresh_run_does_not_mix_with_an_earlier_one(tiny_dataset: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """A run without --resume into a directory that holds an earlier run is refused (its steps would
    interleave in metrics.jsonl and its later checkpoints would be the ones --resume and eval pick); with
    --overwrite the earlier run's outputs are gone and the directory holds exactly this run's."""
    base = train_args(tmp_path, tiny_dataset, [*SMALL, "train.checkpoint_every=20", "train.log_every=10"])
    assert main([*base, "--set", "train.max_steps=60"]) == 0
    assert main([*base, "--set", "train.max_steps=40"]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run" in err and "checkpoints/ckpt_" in err and "--overwrite" in err
    assert max(r[0] for r in _records(tmp_path / "metrics.jsonl")) == 60  # the earlier run is untouched
    assert main([*base, "--set", "train.max_steps=40", "--overwrite"]) == 0
    assert [r[0] for r in _records(tmp_path / "metrics.jsonl") if r[1] == "train"] == [10, 20, 30, 40]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ckpt_000000020.pt", "ckpt_000000040.pt"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 40
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 0  # scores this run's last model, not step 60's
    assert json.loads(capsys.readouterr().out)["auc"] == pytest.approx(summary["auc"], abs=1e-6)


def test_eval_and_predict_cli(tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    s = train_steps(tiny_dataset, tmp_path, ["train.max_steps=30", f'data.eval="{tiny_dataset}"'])
    assert main(["eval", "--checkpoint", str(tmp_path), "--data", str(tiny_dataset)]) == 0
    out = capsys.readouterr().out
    evaluated = json.loads(out[out.index("{"):])
    assert evaluated["num_examples"] == 20000
    assert evaluated["auc"] == pytest.approx(s["auc"], abs=1e-9)
    assert main(["predict", "--checkpoint", str(tmp_path), "--data", str(tiny_dataset),
                 "--out", str(tmp_path / "p.npy")]) == 0
    p = np.load(tmp_path / "p.npy")
    assert p.shape == (20000,) and ((p > 0) & (p < 1)).all()


def test_eval_and_predict_device(tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--device`` picks where the model runs (default cpu); a bad or missing device is an error naming it."""
    import torch

    train_steps(tiny_dataset, tmp_path, ["train.max_steps=20"])
    capsys.readouterr()
    results = {}
    devices = ["cpu", "auto"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        assert main(["eval", "--checkpoint", str(tmp_path), "--device", device]) == 0
        results[device] = json.loads(capsys.readouterr().out)
    for device in devices[1:]:
        for k in ("auc", "logloss"):
            assert results[device][k] == pytest.approx(results["cpu"][k], abs=1e-5), (device, k)
    bad = [("gpu", "--device: 'gpu' is not one of auto, cpu, cuda, cuda:N"), ("cpu:1", "is not one of")]
    if not torch.cuda.is_available():
        bad.append(("cuda", "--device: 'cuda' but CUDA is not available on this machine"))
    for device, message in bad:
        for cmd in (["eval"], ["predict", "--data", str(tiny_dataset), "--out", str(tmp_path / "p.npy")]):
            assert main([cmd[0], "--checkpoint", str(tmp_path), *cmd[1:], "--device", device]) == 2
            assert message in capsys.readouterr().err
    assert not (tmp_path / "p.npy").exists()


def test_eval_of_a_one_class_set_prints_valid_json(tiny_dataset: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """AUC and NE are undefined without both classes: null, as in summary.json, never the non-JSON NaN."""
    import shutil

    train_steps(tiny_dataset, tmp_path / "run", ["train.max_steps=10"])
    negatives = tmp_path / "negatives"
    shutil.copytree(tiny_dataset, negatives)
    np.zeros(20000, np.float32).tofile(negatives / "labels.bin")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(negatives)]) == 0
    out = capsys.readouterr().out
    evaluated = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert evaluated["auc"] is None and evaluated["ne"] is None and evaluated["calibration"] is None
    assert evaluated["num_examples"] == 20000 and evaluated["ctr"] == 0.0


def test_eval_and_predict_report_bad_input_without_a_traceback(tiny_dataset: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    import torch

    train_steps(tiny_dataset, tmp_path / "run", ["train.max_steps=10"])
    run, data = str(tmp_path / "run"), str(tiny_dataset)
    torn = tmp_path / "torn.pt"
    torn.write_bytes((tmp_path / "run" / "checkpoints" / "ckpt_000000010.pt").read_bytes()[:1000])
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": {}, "complete": True}, foreign)  # loads, but holds no training run
    for checkpoint, message in ((torn, "cannot be loaded"), (tmp_path / "missing.pt", "No such file"),
                                (foreign, "not a recstack train checkpoint")):
        capsys.readouterr()
        assert main(["eval", "--checkpoint", str(checkpoint), "--data", data]) == 2
        assert message in capsys.readouterr().err
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit):
            main(["predict", "--checkpoint", run, "--data", data, "--out", str(tmp_path / "p.npy"),
                  "--batch-size", bad])
        assert "--batch-size: must be at least 1" in capsys.readouterr().err
    assert main(["predict", "--checkpoint", run, "--data", data, "--out", str(tmp_path / "p.npz")]) == 2
    assert "expected a .npy or .csv" in capsys.readouterr().err and not (tmp_path / "p.npz").exists()


def test_predict_keeps_row_order_and_does_not_overwrite(tiny_dataset: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Every row once, in data order, whatever the batch size (a last short batch too); an existing --out is
    replaced only with --overwrite, and never left half written."""
    train_steps(tiny_dataset, tmp_path / "run", ["train.max_steps=10"])
    common = ["predict", "--checkpoint", str(tmp_path / "run"), "--data", str(tiny_dataset)]
    csv = tmp_path / "p.csv"
    assert main([*common, "--out", str(csv), "--batch-size", "3000"]) == 0  # 6 full batches and 2000 rows
    rows = np.loadtxt(csv, delimiter=",", skiprows=1)
    labels = np.fromfile(tiny_dataset / "labels.bin", np.float32)
    assert np.array_equal(rows[:, 0], np.arange(20000)) and np.array_equal(rows[:, 2], labels)
    csv.write_text("kept\n")
    assert main([*common, "--out", str(csv)]) == 2
    assert "exists (pass --overwrite" in capsys.readouterr().err and csv.read_text() == "kept\n"
    assert main([*common, "--out", str(csv), "--overwrite", "--batch-size", "7"]) == 0
    again = np.loadtxt(csv, delimiter=",", skiprows=1)
    assert np.allclose(again[:, 1], rows[:, 1], rtol=1e-6, atol=0) and np.array_equal(again[:, 2], labels)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["p.csv", "run"]  # no temporary file left


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'embeding_dim'"):
        load_config(None, ["model.embeding_dim=3"])
    with pytest.raises(ConfigError, match="model.embedding_dim: expected int"):
        load_config(None, ['model.embedding_dim="x"'])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nbatch_size = 1.5\n")
    with pytest.raises(ConfigError, match=f"{bad}.train.batch_size"):
        load_config(bad)
    with pytest.raises(ConfigError, match="optim.sparse"):
        load_config(None, ["optim.sparse=lamb"])
    cfg = load_config(None, ["optim.dense_lr=1", "train.device=cpu"])
    assert cfg.optim.dense_lr == 1.0 and cfg.train.device == "cpu"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.log_every=0", "train.log_every"),
        ("train.epochs=-1", "train.epochs"),
        ("train.epochs=0", "train.epochs"),  # and no max_steps: nothing to train
        ("train.max_steps=-3", "train.max_steps"),
        ("train.eval_every=-5", "train.eval_every"),
        ("train.checkpoint_every=-1", "train.checkpoint_every"),
        ("train.keep_checkpoints=-1", "train.keep_checkpoints"),
        ("train.threads=-1", "train.threads"),
        ("train.seed=-1", "train.seed"),
        ("train.seed=4294967296", "train.seed"),
        ("model.max_table_size=-5", "model.max_table_size"),
        ("model.bottom_mlp=[0, 16]", "model.bottom_mlp"),
        ("model.top_mlp=[-4, 1]", "model.top_mlp"),
        ("model.dcn_layers=-1", "model.dcn_layers"),
        ("model.dcn_low_rank=-1", "model.dcn_low_rank"),  # 0 is full rank
        ("optim.dense_lr=-0.1", "optim.dense_lr"),
        ("optim.dense_lr=nan", "optim.dense_lr"),
        ("optim.sparse_lr=inf", "optim.sparse_lr"),
        ("optim.eps=0", "optim.eps"),
        ("optim.adagrad_init=-1", "optim.adagrad_init"),
        ("dist.timeout_s=0", "dist.timeout_s"),
        ("dist.timeout_s=inf", "dist.timeout_s"),
        ("dist.ranks_per_node=-1", "dist.ranks_per_node"),
        ("dist.forward_codec=fp64", "dist.forward_codec"),
        ("dist.backward_codec=int4", "dist.backward_codec"),
        ("train.device=gpu", "train.device"),
        ("train.device=cpu:1", "train.device"),
        ("train.device=cuda:64", "train.device"),  # more devices than any machine here has, or no CUDA
        ("data.synth.rowz=5", "data.synth: unknown key 'rowz'"),
        ("data.synth.rows=abc", "data.synth.rows"),
        ("data.synth.rows=-5", "data.synth.rows"),
        ("data.synth.table_sizes=[10, 'a']", "data.synth.table_sizes[1]"),
        ("data.synth.target_ctr=1.5", "data.synth.target_ctr"),
    ],
)
def test_out_of_range_values_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(None, [override])


def test_cuda_device_needs_cuda_but_a_saved_config_loads_without(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from recstack.config import config_from_dict

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match="train.device: .* CUDA is not available"):
            load_config(None, [f"train.device={device}"])
        # a checkpoint trained on a GPU still loads here (inference picks its own device)
        assert config_from_dict({"train": {"device": device}}).train.device == device
    with pytest.raises(ConfigError, match="train.device"):
        config_from_dict({"train": {"device": "gpu"}})
    assert load_config(None, ["train.device=auto", "train.max_steps=5", "train.epochs=0"]).train.device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert load_config(None, ["train.device=cuda:1"]).train.device == "cuda:1"
    with pytest.raises(ConfigError, match=r"train.device: 'cuda:2' but this machine has 2 CUDA device\(s\)"):
        load_config(None, ["train.device=cuda:2"])


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("data.synth.num_dense=2", "--set data.synth.num_dense=2: expected KEY=VALUE"),
        ("rowz=5", "SynthConfig: unknown key 'rowz'"),
        ("num_dense=abc", "SynthConfig.num_dense: expected int"),
    ],
)
def test_data_synth_options_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture, option: str,
                                         message: str) -> None:
    out = tmp_path / "synth"
    assert main(["data", "synth", "--out", str(out), "--rows", "200", "--set", option]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_override_sets_one_key_of_a_table() -> None:
    demo = REPO / "configs" / "demo.toml"
    base = load_config(demo).data.synth
    cfg = load_config(demo, ["data.synth.rows=1000"])
    assert cfg.data.synth == {**base, "rows": 1000}  # the table's other keys stay
    assert load_config(demo, ["data.synth={rows=7}"]).data.synth == {"rows": 7}  # a whole table replaces it
    with pytest.raises(ConfigError, match="unknown key 'synthx'"):
        load_config(demo, ["data.synthx.rows=1"])


def test_configs_in_repo_load() -> None:
    recipes = sorted(REPO.joinpath("configs", "recipes").glob("*.toml"))
    assert [p.name for p in recipes] == ["categorical.toml", "criteo.toml", "criteo_small.toml", "ratings_history.toml"]
    for path in [*REPO.joinpath("configs").glob("*.toml"), *recipes]:
        if not path.name.startswith("exfm_"):  # `recstack exfm run` configs have their own schema
            load_config(path)


def test_criteo_recipe_is_the_reference_kaggle_setup() -> None:
    """configs/recipes/criteo.toml and configs/criteo_kaggle.toml differ only in where the data is."""
    recipe, kaggle = load_config(REPO / "configs/recipes/criteo.toml"), load_config(REPO / "configs/criteo_kaggle.toml")
    assert recipe.model == kaggle.model and recipe.optim == kaggle.optim
    assert recipe.train.batch_size == kaggle.train.batch_size and recipe.train.epochs == kaggle.train.epochs
    # The small-data recipe keeps the model and changes only how it is trained.
    small = load_config(REPO / "configs/recipes/criteo_small.toml")
    assert small.model == recipe.model and small.optim != recipe.optim and small.train.early_stopping.patience > 0


def _records(path: Path) -> list[tuple]:
    """(step, kind, loss, auc) of every record of a metrics file: what a resumed run must reproduce."""
    return [(r["step"], r["kind"], r.get("loss"), r.get("auc")) for r in
            (json.loads(x) for x in path.read_text().splitlines())]


def test_resume_continues_metrics_from_the_checkpoint(tiny_dataset: Path, tmp_path: Path, stop_at) -> None:
    """A run stopped after its checkpoint had logged steps past it, the last line torn: the resumed run's
    metrics.jsonl and TensorBoard scalars are those of an uninterrupted run, each step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    extra = ["train.max_steps=100", "train.checkpoint_every=40", "train.eval_every=30", "train.log_every=10"]
    cfg = small_config(tiny_dataset, extra)
    Trainer(cfg, tmp_path / "ref").train()
    stop_at(Trainer(cfg, tmp_path / "run"), 75)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert max(s for s, *_ in _records(metrics)) == 70  # logged after the checkpoint at 40
    with open(metrics, "r+b") as f:  # a line cut short by the kill
        f.truncate(f.seek(0, os.SEEK_END) - 20)
    assert main(train_args(tmp_path / "run", tiny_dataset, [*SMALL, *extra], "--resume")) == 0
    assert _records(metrics) == _records(tmp_path / "ref" / "metrics.jsonl")
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(10, 101, 10))
    assert [e.step for e in acc.Scalars("eval/auc")] == [30, 60, 90, 100]


def test_target_auc_reached_at_the_final_evaluation(tiny_dataset: Path, tmp_path: Path) -> None:
    common = ["train.max_steps=60", "train.eval_every=1000"]  # evaluated once: after the last step
    free = train_steps(tiny_dataset, None, common)
    s = train_steps(tiny_dataset, tmp_path, [*common, f"train.target_auc={free['auc']!r}"])
    assert s["target_reached_step"] == s["steps"] == 60 and s["auc"] == free["auc"]
    assert json.loads((tmp_path / "summary.json").read_text())["target_reached_step"] == 60
    evals = [r for r in _records(tmp_path / "metrics.jsonl") if r[1] == "eval"]
    assert [r[0] for r in evals] == [60]
    short = train_steps(tiny_dataset, None, [*common, f"train.target_auc={free['auc'] + 1e-6!r}"])
    assert short["target_reached_step"] is None


def test_eval_without_data_scores_the_rows_the_run_evaluated(tiny_dataset: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """Not the rows it trained on: the held-out tail (data.eval_fraction), or data.eval when it was set."""
    s = train_steps(tiny_dataset, tmp_path / "tail", ["train.max_steps=30"])
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "tail")]) == 0
    out, err = capsys.readouterr()
    evaluated = json.loads(out)
    assert evaluated["rows"] == [18000, 20000] and evaluated["num_examples"] == 2000 == s["eval_examples"]
    assert evaluated["auc"] == pytest.approx(s["auc"], abs=1e-9)
    assert "rows 18000..19999" in err and "eval_fraction=0.1" in err
    s = train_steps(tiny_dataset, tmp_path / "sep", ["train.max_steps=30", f'data.eval="{tiny_dataset}"'])
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "sep")]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["rows"] == [0, 20000] and evaluated["auc"] == pytest.approx(s["auc"], abs=1e-9)


def test_resume_with_another_batch_size_continues_at_the_same_row(tiny_dataset: Path, tmp_path: Path,
                                                                  stop_at) -> None:
    """The position is kept in rows: 100 batches of 64 done -> the next batch of 128 (or 96) starts at row 6400,
    and train.epochs still ends after one pass over the 18000 training rows, its short last batch included."""
    from recstack.data.prepared_dataset import PreparedDataset

    data = [f'data.train="{tiny_dataset}"', *SMALL, "train.epochs=1", "train.checkpoint_every=50"]
    stop_at(Trainer(load_config(None, data), tmp_path), 100)
    wider = [*data, "train.batch_size=128"]
    with pytest.raises(ConfigError, match="train.shuffle changed from 'none' to 'blocks' in the middle of epoch 0"):
        Trainer(load_config(None, [*wider, "train.shuffle=true"]), tmp_path, resume=True)
    labels = np.asarray(PreparedDataset(tiny_dataset).column("labels"))
    for batch, steps in ((96, -(-11600 // 96)), (128, -(-11600 // 128))):
        out = tmp_path / f"b{batch}"
        shutil.copytree(tmp_path, out, ignore=shutil.ignore_patterns("b*"))
        t = Trainer(load_config(None, [*data, f"train.batch_size={batch}"]), out, resume=True)
        assert (t.step, t.train_loader.position, t.total_steps) == (100, LoaderPosition(0, 6400), 100 + steps)
        seen: list = []
        train_step = t.train_step

        def record(b, seen=seen, train_step=train_step):
            seen.append(b.labels.clone())
            return train_step(b)

        t.train_step = record
        s = t.train()
        assert np.array_equal(torch.cat(seen).numpy(), labels[6400:18000])  # every row left, once, in order
        assert s["train_samples"] == 18000 and s["steps"] == 100 + steps

    # Shuffled blocks are another permutation for another batch size: refused in the middle of an epoch ...
    shuffled = [f'data.train="{tiny_dataset}"', *SMALL, "train.epochs=1", "train.shuffle=true"]
    stop_at(Trainer(load_config(None, [*shuffled, "train.checkpoint_every=50"]), tmp_path / "mid"), 50)
    with pytest.raises(ConfigError, match="another permutation"):
        Trainer(load_config(None, [*shuffled, "train.batch_size=128"]), tmp_path / "mid", resume=True)
    # ... and a finished epoch carries over: the next one starts with batches of the new size.
    Trainer(load_config(None, shuffled), tmp_path / "epoch").train()
    t = Trainer(load_config(None, [*shuffled, "train.epochs=2", "train.batch_size=128"]), tmp_path / "epoch",
                resume=True)
    assert (t.step, t.train_loader.position, t.total_steps) == (282, LoaderPosition(1, 0), 282 + 141)


def test_version_is_the_package_version(capsys: pytest.CaptureFixture) -> None:
    import tomllib

    import recstack

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out.strip() == f"recstack {recstack.__version__}" == f"recstack {project['version']}"
