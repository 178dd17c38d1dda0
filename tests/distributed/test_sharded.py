"""Sharded training in real spawned gloo processes against single-process training (same global batch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import train_step

from recstack.config import load_config
from recstack.data.loader import BatchLoader
from recstack.data.prepared_dataset import PreparedDataset
from recstack.distributed.parallelize import all_gather_metrics, shard_model, wrap_ddp
from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
from recstack.embedding.sparse_optim import sparse_optimizer_config
from recstack.embedding.tiered.collection import TieredEmbeddingCollection
from recstack.metrics import BinaryMetrics
from recstack.models.build import build_model
from recstack.training.step import build_dense_optimizer

GLOBAL_BATCH, STEPS, DIM = 64, 50, 8


def _cfg(sparse_opt: str, extra: tuple[str, ...] = ()):
    return load_config(None, [f"model.embedding_dim={DIM}", f"model.bottom_mlp=[16, {DIM}]", "model.top_mlp=[16, 1]",
                              f'optim.sparse="{sparse_opt}"', "optim.sparse_lr=0.05", "optim.dense_lr=0.05", *extra])


def _run(data: Path, sparse_opt: str, rank: int, world: int, placements=None, ranks_per_node=None,
         aggregate: bool = False, extra: tuple[str, ...] = (), steps: int = STEPS, cache: dict | None = None):
    """Train ``steps`` steps; -> (losses of the global batch, eval AUC, full tables, backward bytes sent).
    ``extra``: config overrides (``--set`` form) on top of the small model (``[memory]`` budgets give the
    shards cached tiers); ``cache`` gets the cached shards' requests and hits on this rank."""
    cfg = _cfg(sparse_opt, extra)
    ds = PreparedDataset(data)
    torch.manual_seed(0)
    # sharded: the tables on "meta" and only this rank's shards drawn (the same rows as the whole tables')
    model = build_model(cfg.model, sparse_optimizer_config(cfg.optim), 13, ds.table_sizes, seed=cfg.train.seed,
                        names=[s.name for s in ds.sparse_features], tables_on_meta=placements is not None)
    device = torch.device("cpu")
    net = model
    if placements is not None:
        model = shard_model(model, placements, 0, device, ranks_per_node=ranks_per_node,
                            aggregate_gradients=aggregate, memory=cfg.memory)
        net = wrap_ddp(model, device)
    opt = build_dense_optimizer(cfg.optim, model.dense_parameters(), model.embeddings)
    n = len(ds)
    loader = BatchLoader(ds, GLOBAL_BATCH // world, (0, n - 2000), rank=rank, world_size=world, prefetch=0)
    losses, bwd_bytes = [], 0.0
    it = loader.iterate_epoch()
    for _ in range(steps):
        global_loss = train_step(net, opt, next(it)).clone()
        if world > 1:
            dist.all_reduce(global_loss)
            global_loss /= world
        losses.append(float(global_loss))
        bwd_bytes += model.embeddings.pop_counters().get("bytes_bwd_a2a", 0.0)
    net.eval()
    metrics = BinaryMetrics()
    ev = BatchLoader(ds, 500 // world, (n - 2000, n), drop_last=False, rank=rank, world_size=world, prefetch=0)
    with torch.no_grad():
        for batch in ev.iterate_epoch():
            metrics.update(net(batch), batch.labels)
    if world > 1:
        metrics = all_gather_metrics(metrics)
    emb = model.embeddings
    tables = [emb.table_weight(t.name) for t in emb.tables]
    if cache is not None and isinstance(emb, ShardedEmbeddingCollection):
        totals = [g.counters.totals() for g in emb.groups.values() if isinstance(g, TieredEmbeddingCollection)]
        cache.update(requests=sum(int(t["requests"]) for t in totals), hits=sum(int(t["hits"]) for t in totals))
    emb.close()
    return losses, metrics.compute()["auc"], tables, bwd_bytes


def _plans(world: int) -> dict[str, tuple[list, int | None]]:
    """Name -> (placements, ranks per node); ``<name>+agg`` runs the same plan with gradient aggregation."""
    everyone = list(range(world))
    half = world // 2
    return {
        "table_wise": ([("table_wise", [t % world]) for t in range(4)], None),
        "row_wise": ([("row_wise", everyone)] * 4, None),
        "column_wise": ([("column_wise", everyone)] * 4, None),
        "data_parallel": ([("data_parallel", everyone)] * 4, None),
        "table_row_wise": ([("table_row_wise", everyone[:half] if t % 2 else everyone[half:]) for t in range(4)],
                           half),
        "mixed": ([("data_parallel", everyone), ("row_wise", everyone), ("table_wise", [world - 1]),
                   ("column_wise", [1, 0])], None),
    }


def _worker(rank: int, world: int, init_file: str, data: str, out: str, sparse_opt: str, names: list[str],
            extra: tuple[str, ...] = (), steps: int = STEPS) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        plans = _plans(world)
        for name in names:
            placements, rpn = plans[name.removesuffix("+agg")]
            results[name] = _run(Path(data), sparse_opt, rank, world, placements, rpn, name.endswith("+agg"), extra,
                                 steps)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, data: Path, world: int, sparse_opt: str, names: list[str],
           extra: tuple[str, ...] = (), steps: int = STEPS) -> dict:
    out = tmp_path / f"res_{world}_{sparse_opt}.pt"
    init = tmp_path / f"init_{world}_{sparse_opt}"
    mp.spawn(_worker, args=(world, str(init), str(data), str(out), sparse_opt, names, extra, steps), nprocs=world,
             join=True)
    return torch.load(out, weights_only=False)


def assert_match_single_process(results: dict, names: list[str], ref: tuple) -> None:
    """The runs ``names`` of ``results`` (``_spawn``) against the single-process run ``ref`` (``_run``): the same
    losses, AUC and tables up to float rounding; and training moved at all."""
    ref_losses, ref_auc, ref_tables, _ = ref
    for name in names:
        losses, auc, tables, _ = results[name]
        assert losses == pytest.approx(ref_losses, abs=1e-5), name
        assert auc == pytest.approx(ref_auc, abs=1e-5), name
        for t, r in zip(tables, ref_tables, strict=True):
            torch.testing.assert_close(t, r, atol=1e-5, rtol=1e-4, msg=f"{name}: tables differ")
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.parametrize("world", [2, 4])
def test_every_sharding_matches_single_process(tiny_dataset: Path, tmp_path: Path, world: int) -> None:
    torch.set_num_threads(1)
    names = [*_plans(world), "row_wise+agg", "table_row_wise+agg", "mixed+agg"]
    ref = _run(tiny_dataset, "sgd", 0, 1)
    results = _spawn(tmp_path, tiny_dataset, world, "sgd", names)
    assert sorted(results) == sorted(names)
    assert_match_single_process(results, names, ref)
    for name in ("row_wise", "table_row_wise", "mixed"):  # one-hot features: far fewer gradient rows sent
        assert results[f"{name}+agg"][3] < 0.8 * results[name][3], name


@pytest.mark.parametrize("sparse_opt", ["sgd", "rowwise_adagrad"])
def test_mixed_table_dims_sharded_match_single_process(tiny_dataset: Path, tmp_path: Path, sparse_opt: str) -> None:
    # model.table_dims: C1 and C3 at their own dims (projected to DIM), C2 and C4 at DIM; "mixed" has one
    # data-parallel table, so the replicated weight still has one dim
    extra = ("model.table_dims={C1 = 4, C3 = 2}",)
    names = ["table_wise", "row_wise", "table_row_wise"]
    if sparse_opt == "sgd":  # column-wise keeps per-shard accumulators (documented): compared with SGD only
        names += ["column_wise", "mixed"]
    ref = _run(tiny_dataset, sparse_opt, 0, 1, extra=extra)
    assert [t.shape[1] for t in ref[2]] == [4, DIM, 2, DIM]
    results = _spawn(tmp_path, tiny_dataset, 2, sparse_opt, names, extra)
    assert_match_single_process(results, names, ref)


def test_rowwise_adagrad_sharded_matches(tiny_dataset: Path, tmp_path: Path) -> None:
    # column-wise keeps per-shard accumulators (documented), so it is left out of this comparison
    names = ["table_wise", "row_wise", "data_parallel", "table_wise+agg", "row_wise+agg"]
    ref_losses, ref_auc, _, _ = _run(tiny_dataset, "rowwise_adagrad", 0, 1)
    results = _spawn(tmp_path, tiny_dataset, 2, "rowwise_adagrad", names)
    for name in names:
        losses, auc, _, _ = results[name]
        assert losses == pytest.approx(ref_losses, abs=1e-5), name
        assert auc == pytest.approx(ref_auc, abs=1e-5), name


# -- the sharded collection alone against one process: empty local batches, empty row shards ---------------
def _sparse_batch(batch: int, rows: list[int], gen: torch.Generator, weighted: bool, max_len: int):
    """Feature-major ids of ``batch`` samples, 0..max_len ids per bag (some bags empty)."""
    from recstack.data.batch import SparseFeatures

    lens = torch.randint(0, max_len + 1, (len(rows), batch), generator=gen)
    ids = torch.cat([torch.randint(0, n, (int(lens[f].sum()),), generator=gen) for f, n in enumerate(rows)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.reshape(-1).cumsum(0)])
    return SparseFeatures(ids, offsets, len(rows), torch.rand(ids.numel(), generator=gen) if weighted else None)


def _samples(sparse, lo: int, hi: int):
    """Samples [lo, hi) of a feature-major SparseFeatures (possibly none)."""
    from recstack.data.batch import SparseFeatures

    b, f = sparse.batch_size, sparse.num_features
    ids, weights, lens = [], [], []
    for i in range(f):
        a, e = int(sparse.offsets[i * b + lo]), int(sparse.offsets[i * b + hi])
        ids.append(sparse.ids[a:e])
        lens.append(sparse.lengths[i * b + lo : i * b + hi])
        if sparse.weights is not None:
            weights.append(sparse.weights[a:e])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lens).cumsum(0)])
    return SparseFeatures(torch.cat(ids), offsets, f, torch.cat(weights) if weights else None)


def _compare_collection(rank: int, world: int, tables, placements, opt: str, per_rank: list[list[int]],
                        weighted: bool = False, aggregate: bool = False, max_len: int = 3) -> dict:
    """Train a sharded collection and a single-process one on the same global batches (``per_rank[step][r]``
    samples of rank r) with the same upstream gradient; -> every rank's outputs and the final tables of both."""
    from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
    from recstack.embedding.fused import FusedEmbeddingBagCollection
    from recstack.embedding.sparse_optim import SparseOptimizerConfig

    cfg = SparseOptimizerConfig(opt, lr=0.1)
    ref = FusedEmbeddingBagCollection(tables, cfg, seed=3)
    sharded = ShardedEmbeddingCollection(tables, cfg, placements, 3, "cpu", aggregate_gradients=aggregate)
    rows = [0] * sum(len(t.features) for t in tables)
    for t in tables:
        for f in t.features:
            rows[f] = t.num_embeddings
    gen = torch.Generator().manual_seed(11)
    outs = []
    for sizes in per_rank:
        bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        sparse = _sparse_batch(bounds[-1], rows, gen, weighted, max_len)
        coef = torch.randn(bounds[-1], len(rows), DIM, generator=gen)
        want = ref(sparse)
        (want * coef).sum().div(world).backward()  # DDP's mean over ranks
        lo, hi = bounds[rank], bounds[rank + 1]
        got = sharded(_samples(sparse, lo, hi))
        assert got.shape == (hi - lo, len(rows), DIM)
        (got * coef[lo:hi]).sum().backward()
        outs.append((got.detach(), want.detach()[lo:hi]))
    return {"outs": outs, "tables": [(sharded.table_weight(t.name), ref.table_weight(t.name).clone())
                                     for t in tables]}


def _collection_worker(rank: int, world: int, init_file: str, out: str, case: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = globals()[case](rank, world, Path(out).parent)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _spawn_case(tmp_path: Path, world: int, case: str) -> dict:
    out = tmp_path / f"{case}.pt"
    mp.spawn(_collection_worker, args=(world, str(tmp_path / f"init_{case}"), str(out), case), nprocs=world,
             join=True)
    return torch.load(out, weights_only=False)


def _assert_same(results: dict) -> None:
    for name, res in results.items():
        for step, (got, want) in enumerate(res["outs"]):
            torch.testing.assert_close(got, want, msg=f"{name}: outputs of step {step} differ")
        for i, (got, want) in enumerate(res["tables"]):
            torch.testing.assert_close(got, want, msg=f"{name}: table {i} differs")


def _empty_batch_cases(rank: int, world: int, tmp: Path) -> dict:
    from recstack.embedding.collection import TableConfig

    tables = [TableConfig("a", 9, DIM, (0,)), TableConfig("b", 5, DIM, (1,)), TableConfig("c", 6, DIM, (2,)),
              TableConfig("d", 3, DIM, (3, 4))]
    mixed = [("row_wise", [0, 1]), ("table_wise", [1]), ("column_wise", [1, 0]), ("data_parallel", [0, 1])]
    steps = [[0, 5], [4, 0], [3, 3]]  # a rank without samples on either side, then both with samples
    return {
        "sgd": _compare_collection(rank, world, tables, mixed, "sgd", steps),
        "sgd weighted": _compare_collection(rank, world, tables, mixed, "sgd", steps, weighted=True),
        "sgd aggregated": _compare_collection(rank, world, tables, mixed, "sgd", steps, aggregate=True, max_len=1),
        "adagrad": _compare_collection(rank, world, tables, [*mixed[:2], ("table_wise", [0]), mixed[3]],
                                       "rowwise_adagrad", steps),
    }


def test_rank_without_samples_joins_every_collective(tmp_path: Path) -> None:
    """The last, short evaluation batch leaves a rank with no samples when it has fewer rows than ranks: that
    rank still joins every collective (input and output all-to-alls, the replicated tables' all-reduce), and
    both ranks' outputs and updates equal one process's on the global batch."""
    results = _spawn_case(tmp_path, 2, "_empty_batch_cases")
    assert any(got.shape[0] == 0 for res in results.values() for got, _ in res["outs"])
    _assert_same(results)


def _empty_shard_cases(rank: int, world: int, tmp: Path) -> dict:
    import json

    from recstack.distributed.config import DistConfig
    from recstack.distributed.parallelize import placements_from_config
    from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
    from recstack.embedding.collection import TableConfig
    from recstack.embedding.sparse_optim import SparseOptimizerConfig
    from recstack.training.checkpoint.sharded import load_sharded, save_sharded

    # blocks of ceil(rows / k) rows: 4 rows over 3 ranks -> 2, 2, 0; 2 rows over 3 -> 1, 1, 0; 1 row over 2 -> 1, 0
    tables = [TableConfig("a", 4, DIM, (0,)), TableConfig("b", 2, DIM, (1, 2)), TableConfig("c", 1, DIM, (3,)),
              TableConfig("d", 9, DIM, (4,))]
    placements = [("row_wise", [0, 1, 2]), ("row_wise", [2, 0, 1]), ("table_row_wise", [1, 2]),
                  ("row_wise", [1, 2, 0])]
    steps = [[3, 2, 4]] * 3
    results = {
        "sgd": _compare_collection(rank, world, tables, placements, "sgd", steps),
        "adagrad aggregated": _compare_collection(rank, world, tables, placements, "rowwise_adagrad", steps,
                                                  aggregate=True, max_len=1),
    }
    # The same layout from a hand-written plan file, as ``dist.plan`` gives it to the trainer.
    plan = tmp / "plan.json"
    if rank == 0:
        entries = [{"name": t.name, "sharding": kind, "ranks": ranks}
                   for t, (kind, ranks) in zip(tables, placements, strict=True)]
        plan.write_text(json.dumps({"world_size": world, "tables": entries}))
    dist.barrier()
    planned = placements_from_config(DistConfig(plan=str(plan)), [t.name for t in tables], world)
    results["plan file"] = _compare_collection(rank, world, tables, planned, "rowwise_adagrad", steps, weighted=True)

    # Checkpoints: empty shards save and load, into a layout with other empty shards.
    cfg = SparseOptimizerConfig("rowwise_adagrad", lr=0.1)
    saved = ShardedEmbeddingCollection(tables, cfg, placements, 5, "cpu")
    saved.train()
    gen = torch.Generator().manual_seed(2)
    sparse = _samples(_sparse_batch(6, [4, 2, 2, 1, 9], gen, False, 3), 2 * rank, 2 * rank + 2)
    (saved(sparse) * torch.randn(2, 5, DIM, generator=gen)).sum().backward()
    path = save_sharded(tmp / "ckpt", 1, saved, {})
    other = [("row_wise", [2, 1, 0]), ("table_wise", [0]), ("row_wise", [0, 1, 2]), ("column_wise", [0, 2])]
    loaded = ShardedEmbeddingCollection(tables, cfg, other, 9, "cpu")
    load_sharded(path, loaded, torch.device("cpu"))
    results["checkpoint"] = {"outs": [], "tables": [(loaded.table_weight(t.name), saved.table_weight(t.name))
                                                    for t in tables]}
    return results


def test_empty_row_shards_match_single_process(tmp_path: Path) -> None:
    """Row blocks of ceil(rows / k) rows leave the last ranks none when a table is small (4 rows over 3 ranks,
    fewer rows than ranks): such a rank holds a zero-row shard, gets no ids and returns zero partial sums."""
    _assert_same(_spawn_case(tmp_path, 3, "_empty_shard_cases"))


if os.environ.get("RECSTACK_SKIP_DIST"):
    pytestmark = pytest.mark.skip("RECSTACK_SKIP_DIST set")
