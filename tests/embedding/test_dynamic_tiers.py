"""Dynamic id tables behind memory tiers: ``reset_rows`` of the tiered collection reaches every copy of a row (the
store, the cache slot, a staging row, a prefetched copy), and dynamic-id training runs whose device caches hold
fewer rows than the id maps use end exactly as the same runs with every row in memory, resumed or not."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import kill_after_checkpoints, run_cli, train_args

from recstack.config import load_config
from recstack.data.batch import SparseFeatures
from recstack.embedding.collection import TableConfig
from recstack.embedding.fused import FusedEmbeddingBagCollection
from recstack.embedding.sparse_optim import SparseOptimizerConfig
from recstack.embedding.tiered.collection import TablePlacement, TieredEmbeddingCollection

TABLES = [TableConfig("a", 40, 4, (0,)), TableConfig("b", 300, 4, (1,)), TableConfig("c", 500, 4, (2,))]


@pytest.mark.parametrize(("kind", "policy"), [("rowwise_adagrad", "lru"), ("sgd", "lfu")])
def test_reset_rows_reaches_every_copy_of_a_row(tmp_path: Path, kind: str, policy: str) -> None:
    """Steps with every next batch announced (its rows prefetched while the step computes), then rows reset
    between steps as the dynamic ids' remap does: among them rows the prefetch just brought in for the next
    batch, rows resident and dirty, rows only in the stores. Every output and the final tables (weights and
    accumulators) equal those of the all-in-memory collection given the same resets."""
    opt = SparseOptimizerConfig(kind, 0.2)
    ref = FusedEmbeddingBagCollection(TABLES, opt, seed=3)
    tiered = TieredEmbeddingCollection(TABLES, opt, [TablePlacement(), TablePlacement("host-cached", 32, policy),
                                                     TablePlacement("ssd-cached", 33, policy)],
                                       seed=3, ssd_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    batches = [SparseFeatures.from_dense_ids(torch.stack([torch.randint(0, t.num_embeddings, (48,), generator=g)
                                                          for t in TABLES], 1)) for _ in range(12)]
    hook = tiered.ids_hook()
    assert hook is not None
    for s in batches:
        hook(s)
    grad = torch.randn(48, 3, 4, generator=g)
    for step, s in enumerate(batches):
        out = tiered(s)
        assert torch.equal(out, ref(s)), step
        (out * grad).sum().backward()
        (ref(s) * grad).sum().backward()
        if step + 1 < len(batches):  # the prefetch of the next batch may still be running
            nxt = batches[step + 1].ids.view(3, 48)
            for ti, t in enumerate(TABLES):
                rows = torch.cat([nxt[ti, :4], torch.randint(0, t.num_embeddings, (6,), generator=g)]).unique()
                values = torch.randn(rows.numel(), 4, generator=g)
                tiered.reset_rows(t.name, rows, values)
                ref.reset_rows(t.name, rows, values)
    totals = tiered.counters.totals()
    assert totals["evictions"] > 0 and totals["hits"] > 0 and totals["prefetch_seconds"] > 0
    for ti, t in enumerate(TABLES):
        w, acc = tiered.table_state(t.name)
        assert torch.equal(w, ref.table_weight(t.name)), t.name
        if ref.accumulator is not None:
            r0 = int(ref.table_offsets[ti])
            assert acc is not None and torch.equal(acc, ref.accumulator[r0 : r0 + t.num_embeddings]), t.name
    with pytest.raises(ValueError, match="reset_rows: table 'b' has rows \\[0, 300\\), got \\[300\\]"):
        tiered.reset_rows("b", torch.tensor([300]), torch.zeros(1, 4))
    tiered.close()


# Capacity 160 rows of 20 bytes (4 weights + an accumulator) per table. 1600 bytes of device memory keep no
# table there: each gets a 26-row cache, C1's and C2's rows in host memory (6400 bytes), C3's in a file.
DYN = ["model.embedding_dim=4", "model.bottom_mlp=[8, 4]", "model.top_mlp=[8, 1]", "train.batch_size=128",
       "train.progress=false", "train.threads=1", "model.dynamic_ids.enabled=true",
       "model.dynamic_ids.capacity=160", "model.dynamic_ids.admit_after=2", 'optim.sparse="rowwise_adagrad"',
       "optim.sparse_lr=0.05", "train.eval_every=20", "train.shuffle=true"]
TIERS = ['memory.device="1600"', 'memory.host="6400"']
METRICS = ("auc", "logloss", "ne", "steps", "train_samples")


def _trainer(data: Path, out: Path | None, extra: list[str], resume: bool = False) -> Any:
    from recstack.training.trainer import Trainer

    return Trainer(load_config(None, [f'data.train="{data}"', *DYN, *extra]), out, resume=resume)


def _tables(trainer: Any) -> dict[str, torch.Tensor]:
    """Every table's weight and (Adagrad) accumulator, however held, and the dense parameters."""
    emb = trainer.model.embeddings
    out = {}
    for ti, t in enumerate(emb.tables):
        if isinstance(emb, TieredEmbeddingCollection):
            w, acc = emb.table_state(t.name)
        else:
            r0, r1 = int(emb.table_offsets[ti]), int(emb.table_offsets[ti + 1])
            w, acc = emb.table_weight(t.name), emb.accumulator[r0:r1]
        out[t.name], out[f"{t.name}/acc"] = w, acc
    out.update({k: v for k, v in trainer.model.state_dict().items() if not k.startswith("embeddings.")})
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


def test_dynamic_ids_in_cached_tiers_match_all_in_memory(churn_data: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """Id maps evicting (rows reused and reset) over host- and ssd-cached tables whose 26-row caches hold fewer
    rows than the maps use (cache evictions): the same losses, evaluations, id map counters and final tables as
    with every row in memory; `recstack eval` of its checkpoint directory gives the same AUC."""
    extra = ["train.max_steps=45", "train.log_every=5"]
    ref_t = _trainer(churn_data, tmp_path / "ref", extra)
    ref = ref_t.train()
    capsys.readouterr()
    run_t = _trainer(churn_data, tmp_path / "run", [*extra, *TIERS, f'memory.ssd_dir="{tmp_path / "ssd"}"'])
    plan = capsys.readouterr().out
    assert "host-cached" in plan and "ssd-cached" in plan, plan
    run = run_t.train()
    assert isinstance(run_t.model.embeddings, TieredEmbeddingCollection)
    assert ref["dynamic_ids/evictions"] > 0 and ref["dynamic_ids/rows_in_use"] > 3 * 26
    keys = [*METRICS, *(k for k in ref if k.startswith("dynamic_ids/"))]
    assert {k: run[k] for k in keys} == {k: ref[k] for k in keys}
    _same(_tables(run_t), _tables(ref_t))
    logs = [[json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("ref", "run")]
    assert [(x["kind"], x.get("loss"), x.get("auc")) for x in logs[0]] == \
        [(x["kind"], x.get("loss"), x.get("auc")) for x in logs[1]]
    train = [x for x in logs[1] if x["kind"] == "train"]
    assert sum(x["cache_requests"] - x["cache_hits"] for x in train) > 0
    assert run_t.model.embeddings.counters.totals()["evictions"] > 0
    ref_t.close()
    run_t.close()
    from recstack.cli.main import main

    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0  # the tiered checkpoint's maps and tables
    assert json.loads(capsys.readouterr().out)["auc"] == ref["auc"]


def test_stopped_and_resumed_in_tiers_matches_all_in_memory(churn_data: Path, tmp_path: Path, stop_at) -> None:
    """A tiered dynamic-id run stopped after its step-20 checkpoint and resumed ends with the uninterrupted
    all-in-memory run's maps, tables and metrics."""
    extra = ["train.max_steps=40", "train.checkpoint_every=20"]
    tiers = [*TIERS, f'memory.ssd_dir="{tmp_path / "ssd"}"']
    ref_t = _trainer(churn_data, tmp_path / "ref", extra)
    ref = ref_t.train()
    part = _trainer(churn_data, tmp_path / "run", [*extra, *tiers])
    stop_at(part, 25)
    part.close()
    resumed = _trainer(churn_data, tmp_path / "run", [*extra, *tiers], resume=True)
    assert resumed.step == 20
    run = resumed.train()
    keys = [*METRICS, *(k for k in ref if k.startswith("dynamic_ids/"))]
    assert ref["dynamic_ids/evictions"] > 0 and {k: run[k] for k in keys} == {k: ref[k] for k in keys}
    _same(_tables(resumed), _tables(ref_t))
    for name, m in ref_t.dynamic.maps.items():
        for k, v in m.state_dict().items():
            other = resumed.dynamic.maps[name].state_dict()[k]
            assert torch.equal(v, other) if isinstance(v, torch.Tensor) else v == other, (name, k)
    ref_t.close()
    resumed.close()


def test_sigkill_then_resume_ssd_cached_dynamic_matches_uninterrupted(churn_data: Path, tmp_path: Path) -> None:
    """`recstack train` killed after two checkpoints, its SSD table file gone with it, resumes to the end of the
    uninterrupted run."""
    opts = [*DYN, "train.max_steps=60", "train.checkpoint_every=15", 'memory.device="1600"', 'memory.host="0"']
    ref = run_cli(train_args(tmp_path / "ref", churn_data, [*opts, f'memory.ssd_dir="{tmp_path / "ssd_ref"}"']))
    assert ref.returncode == 0, ref.stderr
    run = train_args(tmp_path / "run", churn_data, [*opts, f'memory.ssd_dir="{tmp_path / "ssd"}"'])
    killed = kill_after_checkpoints(run, tmp_path / "run" / "checkpoints", 2)
    assert killed.returncode == -signal.SIGKILL, "training finished before it could be killed"
    assert list((tmp_path / "ssd").iterdir()) == []
    resumed = run_cli([*run, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    a, b = (json.loads((tmp_path / r / "summary.json").read_text()) for r in ("ref", "run"))
    keys = [*METRICS, *(k for k in a if k.startswith("dynamic_ids/"))]
    assert a["dynamic_ids/evictions"] > 0 and {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_raw_stream_in_tiers_matches_all_in_memory(shared_data: Path, tmp_path: Path) -> None:
    """A raw Criteo stream (every table dynamic) over 26 tables of 200 rows, 13 host- and 12 ssd-cached with 36-row
    caches: the progressive metrics and the final tables of the stream run with every row in memory."""
    from recstack.data.stream import DirectoryStream, partition_reader
    from recstack.training.stream import StreamTrainer

    lines = (shared_data / "criteo_kaggle_sample.tsv").read_text().splitlines(keepends=True)
    (tmp_path / "in").mkdir()
    for i in range(2):
        (tmp_path / "in" / f"part-{i:03d}").write_text("".join(lines[i * 400 : (i + 1) * 400]))
    opts = ["model.embedding_dim=8", "model.bottom_mlp=[32, 8]", "model.top_mlp=[32, 1]", "train.batch_size=64",
            "train.threads=1", "train.progress=false", 'optim.sparse="rowwise_adagrad"',
            "model.dynamic_ids.enabled=true", "model.dynamic_ids.capacity=200"]
    tiers = ['memory.device="40KB"', 'memory.host="100KB"', f'memory.ssd_dir="{tmp_path / "ssd"}"']
    runs, summaries = [], []
    for name, extra in (("ref", []), ("run", tiers)):
        t = StreamTrainer(load_config(None, [*opts, *extra]), DirectoryStream(tmp_path / "in", idle_s=0),
                          partition_reader(None, 0), tmp_path / name)
        summaries.append(t.train())
        runs.append(t)
    ref, run = summaries
    emb = runs[1].model.embeddings
    assert isinstance(emb, TieredEmbeddingCollection) and not isinstance(runs[0].model.embeddings, type(emb))
    assert sorted(p.tier for p in emb.placements) == ["device"] + ["host-cached"] * 13 + ["ssd-cached"] * 12
    keys = ["steps", "progressive_auc", "progressive_logloss", *(k for k in ref if k.startswith("dynamic_ids/"))]
    assert ref["dynamic_ids/evictions"] > 0 and {k: run[k] for k in keys} == {k: ref[k] for k in keys}
    _same(_tables(runs[1]), _tables(runs[0]))
    for t in runs:
        t.close()
