"""Sharding planner: plan format and validation, cost model terms, search quality against brute force,
memory limits, infeasible requests, the ``recstack plan`` command line."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import time

import numpy as np
import pytest

from recstack.cli import plan as cli
from recstack.distributed.planner.cost import TERMS, CostConfig, CostModel, row_access
from recstack.distributed.planner.inputs import PlanError, TableSpec, Topology
from recstack.distributed.planner.partition import plan_sharding
from recstack.distributed.planner.plan import ShardingPlan
from recstack.distributed.sharding import SHARDING_TYPES, row_blocks

GB = 10**9


# -- brute force under the same cost model ---------------------------------------------------------------
def _placements(table: TableSpec, model: CostModel, allowed: list[str], min_column_dim: int) -> list:
    """Every (sharding, ranks) the table can take, as (cost [W], hbm [W]) vectors, duplicates removed."""
    topo = model.topology
    W, L = topo.world_size, topo.devices_per_node
    out = {}

    def add(sharding: str, ranks: tuple[int, ...]) -> None:
        est = model.estimate(table, sharding, len(ranks))
        cost, hbm = np.zeros(W), np.zeros(W, dtype=np.int64)
        cost[list(ranks)] += est.cost
        hbm[list(ranks)] += est.hbm
        out.setdefault((tuple(np.round(cost, 18)), tuple(hbm)), (cost, hbm))

    for sharding in allowed:
        if sharding == "data_parallel":
            add(sharding, tuple(range(W)))
        elif sharding == "table_wise":
            for r in range(W):
                add(sharding, (r,))
        else:
            ks = range(1, (L if sharding == "table_row_wise" else W) + 1)
            groups = [range(n * L, (n + 1) * L) for n in range(topo.nodes)] if sharding == "table_row_wise" \
                else [range(W)]
            for k, group in itertools.product(ks, groups):
                if sharding == "column_wise" and (table.dim % k or table.dim // k < min_column_dim):
                    continue
                if sharding != "column_wise" and any(hi <= lo for lo, hi in row_blocks(table.rows, k)):
                    continue
                for ranks in itertools.permutations(group, k):
                    add(sharding, ranks)
    return list(out.values())


def brute_force_max(tables, topo, batch, allowed, min_column_dim=8) -> float:
    """Exact minimum over all plans of the slowest rank's cost (inf if nothing fits). Depth-first over
    tables with a lower bound, merging states that differ only by a permutation of ranks inside a node or
    of whole nodes (equivalent for every completion)."""
    model = CostModel(topo, batch)
    L = topo.devices_per_node
    options = [_placements(t, model, a, min_column_dim) for t, a in zip(tables, allowed, strict=True)]
    order = sorted(range(len(tables)), key=lambda i: -min(c.sum() for c, _ in options[i]))
    options = [options[i] for i in order]
    rest = np.cumsum([min(c.sum() for c, _ in o) for o in options][::-1])[::-1].tolist() + [0.0]
    best = math.inf
    seen: set = set()

    def key(depth, load, hbm):
        nodes = (tuple(sorted(zip(np.round(load[n * L:(n + 1) * L], 15), hbm[n * L:(n + 1) * L], strict=True)))
                 for n in range(topo.nodes))
        return depth, tuple(sorted(nodes))

    def dfs(depth, load, hbm):
        nonlocal best
        if max(load.max(), (load.sum() + rest[depth]) / len(load)) >= best * (1 - 1e-12):
            return
        if depth == len(options):
            best = float(load.max())
            return
        k = key(depth, load, hbm)
        if k in seen:
            return
        seen.add(k)
        for cost, mem in options[depth]:
            new_hbm = hbm + mem
            if (new_hbm <= topo.hbm_bytes).all():
                dfs(depth + 1, load + cost, new_hbm)

    dfs(0, np.zeros(topo.world_size), np.zeros(topo.world_size, dtype=np.int64))
    return best


def random_instance(seed: int):
    rng = np.random.default_rng(seed)
    nodes, per_node = [(1, 2), (1, 3), (1, 4), (2, 2)][seed % 4]
    tables = []
    for i in range(int(rng.integers(3, 7))):
        rows = int(10 ** rng.uniform(1, 6.5))
        counts = None
        if rng.random() < 0.3:  # skewed ids: earlier rows hotter
            counts = tuple(float(x) for x in np.sort(rng.zipf(1.5, int(rng.integers(2, 9))))[::-1])
        tables.append(TableSpec(f"t{i}", rows, int(rng.choice([8, 16, 32])), float(rng.choice([1, 3, 20])), counts))
    allowed = [sorted(rng.choice(SHARDING_TYPES, size=int(rng.integers(2, 4)), replace=False).tolist())
               for _ in tables]
    w = CostConfig().weight_bytes + CostConfig().state_bytes
    largest = max(math.ceil(t.rows / (nodes * per_node)) * t.dim * w for t in tables)
    total = sum(t.rows * t.dim * w for t in tables)
    hbm = int(max(largest * 1.5, total / (nodes * per_node) * rng.uniform(0.9, 2.0)))
    topo = Topology(nodes, per_node, hbm_bytes=hbm, inter_bw=float(rng.choice([12.5e9, 100e9])))
    return tables, topo, int(rng.choice([64, 1024, 8192])), allowed


@pytest.mark.parametrize("seed", range(60))
def test_planner_within_ten_percent_of_brute_force(seed: int) -> None:
    tables, topo, batch, allowed = random_instance(seed)
    optimum = brute_force_max(tables, topo, batch, allowed)
    constraints = {t.name: a for t, a in zip(tables, allowed, strict=True)}
    if math.isinf(optimum):
        with pytest.raises(PlanError):
            plan_sharding(tables, topo, batch, constraints=constraints)
        return
    plan = plan_sharding(tables, topo, batch, constraints=constraints, time_limit_s=2.0)
    plan.validate(topo.world_size, tables)  # includes HBM per rank <= topology.hbm_bytes
    assert plan.cost["max"] >= optimum * (1 - 1e-9)
    assert plan.cost["max"] <= 1.10 * optimum, (plan.cost["max"], optimum)
    for t, a in zip(plan.tables, allowed, strict=True):
        assert t.sharding in a


# -- plan format and validation ------------------------------------------------------------------------
def _small_plan() -> tuple[ShardingPlan, list[TableSpec]]:
    tables = [TableSpec("big", 100_000, 16, 2.0), TableSpec("mid", 5_000, 16), TableSpec("tiny", 3, 16),
              TableSpec("wide", 20_000, 32)]
    plan = plan_sharding(tables, Topology(2, 2), 256, constraints={"big": "row_wise", "mid": "table_row_wise",
                                                                     "tiny": "data_parallel", "wide": "column_wise"})
    return plan, tables


def test_plan_json_shape_and_round_trip() -> None:
    plan, tables = _small_plan()
    d = json.loads(plan.to_json())
    assert set(d) == {"version", "world_size", "topology", "batch_size_per_rank", "tables", "cost"}
    assert (d["version"], d["world_size"], d["batch_size_per_rank"]) == (1, 4, 256)
    assert [t["name"] for t in d["tables"]] == ["big", "mid", "tiny", "wide"]  # input order
    for t in d["tables"]:
        assert set(t) == {"name", "rows", "dim", "sharding", "ranks", "memory_bytes_per_rank"}
        assert sorted(int(r) for r in t["memory_bytes_per_rank"]) == sorted(t["ranks"])
    assert {"per_rank", "max", "mean", "imbalance"} <= set(d["cost"])
    assert d["cost"]["imbalance"] == pytest.approx(max(d["cost"]["per_rank"]) / np.mean(d["cost"]["per_rank"]))
    assert d["tables"][2]["ranks"] == [0, 1, 2, 3]
    again = ShardingPlan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()
    again.validate(4, tables)


def _edit(plan: ShardingPlan, i: int, **changes) -> ShardingPlan:
    d = plan.to_dict()
    d["tables"][i].update(changes)
    if "ranks" in changes and "memory_bytes_per_rank" not in changes:
        d["tables"][i]["memory_bytes_per_rank"] = {str(r): 0 for r in changes["ranks"]}
    return ShardingPlan.from_json(json.dumps(d))


@pytest.mark.parametrize(("index", "changes", "message"), [
    (0, {"name": "nope"}, "unknown table"),
    (0, {"sharding": "rowwise"}, "unknown sharding 'rowwise'"),
    (0, {"ranks": [0, 4]}, "out of range"),
    (0, {"ranks": [1, 1]}, "appears twice"),
    (3, {"sharding": "column_wise", "ranks": [0, 1, 2]}, "dim divisible by 3"),
    (1, {"sharding": "table_row_wise", "ranks": [1, 2]}, "share one node"),
    (2, {"sharding": "data_parallel", "ranks": [0, 1]}, "every rank"),
    (1, {"sharding": "table_wise", "ranks": [0, 1]}, "exactly one rank"),
    (2, {"sharding": "row_wise", "ranks": [0, 1, 2, 3]}, "shard\\(s\\) \\[3\\] empty"),  # 3 rows, blocks of 1
    (1, {"rows": 7}, "the table is"),
    (0, {"memory_bytes_per_rank": {"0": 1}}, "memory_bytes_per_rank"),
])
def test_validate_rejects_bad_plans(index: int, changes: dict, message: str) -> None:
    plan, tables = _small_plan()
    with pytest.raises(PlanError, match=message):
        _edit(plan, index, **changes).validate(4, tables)


def test_validate_checks_world_size_memory_and_missing_tables() -> None:
    plan, tables = _small_plan()
    _edit(plan, 2, sharding="row_wise", ranks=[0, 1, 2]).validate(4, tables)  # 3 rows over 3 ranks is fine
    with pytest.raises(PlanError, match="world size 4"):
        plan.validate(8, tables)
    with pytest.raises(PlanError, match="no entry"):
        plan.validate(4, [*tables, TableSpec("extra", 10, 4)])
    heavy = _edit(plan, 0, memory_bytes_per_rank={str(r): 10**12 for r in plan.tables[0].ranks})
    with pytest.raises(PlanError, match="HBM per rank"):
        heavy.validate(4, tables)
    with pytest.raises(PlanError, match="version"):
        ShardingPlan.from_json(json.dumps({**plan.to_dict(), "version": 2}))
    with pytest.raises(PlanError, match="missing field 'ranks'"):
        d = plan.to_dict()
        del d["tables"][1]["ranks"]
        ShardingPlan.from_json(json.dumps(d))


# -- cost model ----------------------------------------------------------------------------------------------
def _term(est, name: str) -> np.ndarray:
    return est.terms[:, TERMS.index(name)]


def test_cost_terms_follow_the_documented_formulas() -> None:
    topo = Topology(2, 4, intra_bw=100e9, inter_bw=10e9, hbm_bw=1e12)
    B, W, L = 512, 8, 4
    G = B * W
    model = CostModel(topo, B)
    t = TableSpec("t", 1_000_000, 32, pooling=4.0)

    def link(x):  # 3 peers in the node, 4 outside
        return (L - 1) * x / 100e9 + (W - L) * x / 10e9

    tw = model.estimate(t, "table_wise", 1)
    touched = t.rows * -math.expm1(-G * 4.0 / t.rows)
    assert _term(tw, "lookup")[0] == pytest.approx(G * 5 * 32 * 4 / 1e12)
    assert _term(tw, "input_dist")[0] == pytest.approx(link(B * 5 * 8))
    assert _term(tw, "output_dist")[0] == pytest.approx(link(B * 32 * 4))
    assert _term(tw, "backward")[0] == pytest.approx((G * 5 * 32 * 4 + touched * (2 * 32 * 4 + 8)) / 1e12)
    assert tw.hbm[0] == t.rows * (32 * 4 + 4)

    rw = model.estimate(t, "row_wise", 4)  # every row shard sends full-width partial sums
    assert _term(rw, "output_dist").sum() == pytest.approx(4 * _term(tw, "output_dist")[0])
    assert _term(rw, "lookup").sum() == pytest.approx(G * (4 + 4) * 32 * 4 / 1e12)  # ids split, lengths not
    assert rw.hbm.tolist() == [250_000 * 132] * 4
    cw = model.estimate(t, "column_wise", 4)  # every column block needs all ids
    assert _term(cw, "input_dist").sum() == pytest.approx(4 * _term(tw, "input_dist")[0])
    assert _term(cw, "output_dist").sum() == pytest.approx(_term(tw, "output_dist")[0])
    assert cw.hbm.tolist() == [t.rows * (8 * 4 + 4)] * 4  # Adagrad state per row in every column block

    trw = model.estimate(t, "table_row_wise", 4)
    assert _term(trw, "output_dist")[0] == pytest.approx(3 / 4 * G * 32 * 4 / 100e9 + link(B * 32 * 4 / 4))
    fast_intra = CostModel(Topology(2, 4, intra_bw=1e30, inter_bw=10e9), B)  # only inter-node traffic left
    assert _term(fast_intra.estimate(t, "table_row_wise", 4), "output_dist").sum() == pytest.approx(
        _term(fast_intra.estimate(t, "table_wise", 1), "output_dist")[0])

    dp = model.estimate(TableSpec("s", 100, 32), "data_parallel", W)
    S = 100 * 32 * 4
    assert len(dp.cost) == W
    assert _term(dp, "allreduce")[0] == pytest.approx(2 * 3 / 4 * S / 100e9 + 2 * 1 / 2 * (S / 4) / 10e9)
    assert _term(dp, "output_dist")[0] == 0 and _term(dp, "input_dist")[0] == 0
    assert dp.hbm[0] == 100 * (32 * 4 + 4) + S  # replica + state + dense gradient buffer
    sgd = CostModel(topo, B, CostConfig(optimizer="sgd"))
    assert sgd.estimate(t, "table_wise", 1).hbm[0] == t.rows * 32 * 4


def test_codec_row_bytes_count_in_the_all_to_all_cost() -> None:
    """fp8 and int8 send a scale (int8 also a min) with every row: the planner charges it once per pooled row,
    so a narrow column block pays it in full."""
    from recstack.compression.registry import get_codec

    for name, elem in cli.ELEMENT_BYTES.items():  # the CLI's figures are the codecs' own payload sizes
        assert get_codec(name).payload_bytes((3, 5)) == 3 * (5 * elem + cli.CODEC_ROW_BYTES[name]), name
    B, W, L = 512, 8, 4
    G = B * W
    topo = Topology(2, 4, intra_bw=100e9, inter_bw=10e9)
    int8 = CostModel(topo, B, CostConfig(fwd_comm_bytes=1, bwd_comm_bytes=1, fwd_row_bytes=8, bwd_row_bytes=8))
    t = TableSpec("t", 100_000, 16)

    def link(x):
        return (L - 1) * x / 100e9 + (W - L) * x / 10e9

    cw = int8.estimate(t, "column_wise", 2)  # blocks of 8 columns: 8 code bytes + 8 header bytes per row
    assert _term(cw, "output_dist")[0] == pytest.approx(link(B * 16))
    assert _term(cw, "grad_dist")[0] == pytest.approx(link(B * 16))
    trw = int8.estimate(t, "table_row_wise", 4)
    assert _term(trw, "output_dist")[0] == pytest.approx(3 / 4 * G * (16 + 8) / 100e9 + link(B * (16 / 4 + 8)))
    plan = _run_cli(["--synthetic-tables", "2", "--rows", "1000", "--dim", "16", "--topology", "1x2",
                     "--forward-codec", "int8", "--backward-codec", "fp8", "--time-limit", "0.5"])
    assert (plan.cost["config"]["fwd_row_bytes"], plan.cost["config"]["bwd_row_bytes"]) == (8, 4)


def test_row_access_splits_lookups_by_histogram() -> None:
    uniform = TableSpec("u", 1000, 8)
    share, distinct = row_access(uniform, [(0, 250), (250, 1000)], 400.0)
    assert share.tolist() == pytest.approx([0.25, 0.75])
    assert distinct.tolist() == pytest.approx([250 * -math.expm1(-100 / 250), 750 * -math.expm1(-300 / 750)])
    hot = TableSpec("h", 1000, 8, access_counts=(3, 1))  # rows 0..499 get 3/4 of the ids
    share, _ = row_access(hot, [(0, 500), (500, 1000)], 400.0)
    assert share.tolist() == pytest.approx([0.75, 0.25])
    est = CostModel(Topology(1, 2), 64).estimate(hot, "row_wise", 2)
    assert _term(est, "lookup")[0] > _term(est, "lookup")[1]


def test_plan_cost_matches_cost_model() -> None:
    plan, tables = _small_plan()
    again = CostModel(plan.topology, plan.batch_size_per_rank).plan_cost(tables, plan.tables)
    assert again["per_rank"] == pytest.approx(plan.cost["per_rank"])
    assert again["hbm_bytes_per_rank"] == plan.cost["hbm_bytes_per_rank"]
    assert sum(sum(t.memory_bytes_per_rank.values()) for t in plan.tables) == sum(plan.cost["hbm_bytes_per_rank"])
    breakdown = np.array([plan.cost["breakdown"][n] for n in TERMS]).sum(axis=0)
    assert breakdown == pytest.approx(plan.cost["per_rank"])


# -- planner behaviour --------------------------------------------------------------------------------------
def test_force_and_constraints() -> None:
    tables = [TableSpec(f"t{i}", 10 ** (i + 2), 16) for i in range(4)] + [TableSpec("odd", 1000, 13)]
    topo = Topology(1, 4)
    plan = plan_sharding(tables, topo, 128, force="row_wise")
    assert {t.sharding for t in plan.tables} == {"row_wise"}
    plan = plan_sharding(tables, topo, 128, force="column_wise")  # 13 columns split only as one block
    assert {t.sharding for t in plan.tables} == {"column_wise"}
    assert plan.table("odd").ranks and len(plan.table("odd").ranks) == 1
    plan = plan_sharding(tables, topo, 128, constraints={"t3": "table_wise", "t0": ["data_parallel"]})
    assert plan.table("t3").sharding == "table_wise" and plan.table("t0").sharding == "data_parallel"
    with pytest.raises(PlanError, match="unknown table"):
        plan_sharding(tables, topo, 128, constraints={"zz": "table_wise"})
    with pytest.raises(PlanError, match="unknown sharding"):
        plan_sharding(tables, topo, 128, force="rows")


def test_table_of_an_always_empty_feature_is_planned() -> None:
    """Pooling 0 (a feature with no ids in the data) still leaves a table to place and bag lengths to send."""
    tables = [TableSpec("empty", 1000, 16, pooling=0.0), TableSpec("a", 100_000, 16)]
    plan = plan_sharding(tables, Topology(1, 2), 256, time_limit_s=0.5)
    plan.validate(2, tables)
    est = CostModel(Topology(1, 2), 256).estimate(tables[0], "table_wise", 1)
    assert np.isfinite(est.cost).all() and _term(est, "input_dist")[0] > 0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(PlanError, match="'pooling' must be a non-negative number"):
            TableSpec("x", 10, 4, pooling=bad)


def test_small_tables_replicate_and_large_tables_split_when_memory_demands() -> None:
    topo = Topology(2, 2, hbm_bytes=600 * 10**6)
    tables = [TableSpec("tiny", 3, 16), TableSpec("huge", 2_000_000, 128)]  # 1.04 GB: over one device
    plan = plan_sharding(tables, topo, 1024)
    plan.validate(4, tables)
    assert plan.table("tiny").sharding == "data_parallel"
    assert len(plan.table("huge").ranks) >= 2
    assert max(plan.cost["hbm_bytes_per_rank"]) <= topo.hbm_bytes


def test_impossible_requests_say_how_much_memory_is_needed() -> None:
    topo = Topology(1, 4, hbm_bytes=10**9)
    big = TableSpec("big", 50_000_000, 64)  # 13.2 GB: 3.3 GB per rank even row-wise over all 4
    need = math.ceil(big.rows / 4) * (64 * 4 + 4)
    with pytest.raises(PlanError, match=f"{need:,} bytes") as err:
        plan_sharding([big], topo, 128)
    assert "'big'" in str(err.value) and "per rank" in str(err.value)
    with pytest.raises(PlanError, match=f"{big.rows * (64 * 4 + 4):,} bytes\\) on one rank"):
        plan_sharding([big], Topology(1, 4, hbm_bytes=10 * GB), 128, force="table_wise")  # row_wise would fit
    many = [TableSpec(f"t{i}", 3_000_000, 64) for i in range(6)]  # each fits, together 4.68 GB > 4 GB
    total_need = math.ceil(6 * 3_000_000 * 260 / 4)
    with pytest.raises(PlanError, match=f"{total_need:,} bytes\\) per rank"):
        plan_sharding(many, topo, 128)


def test_hundreds_of_tables_on_128_ranks_in_seconds() -> None:
    rng = np.random.default_rng(1)
    tables = [TableSpec(f"t{i}", int(10 ** rng.uniform(2, 8)), int(rng.choice([32, 64, 128])),
                        float(rng.choice([1, 4, 20]))) for i in range(300)]
    topo = Topology(16, 8, hbm_bytes=80 * GB)
    start = time.perf_counter()
    plan = plan_sharding(tables, topo, 1024, time_limit_s=3.0)
    elapsed = time.perf_counter() - start
    assert elapsed < 20, elapsed
    plan.validate(128, tables)
    assert [t.name for t in plan.tables] == [t.name for t in tables]
    assert plan.cost["imbalance"] < 1.5  # 300 tables over 128 ranks leave room to balance


# -- command line -----------------------------------------------------------------------------------------
def _run_cli(argv: list[str]) -> ShardingPlan:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_units() -> None:
    assert cli.parse_size("80GB") == 80 * 10**9
    assert cli.parse_size("64GiB") == 64 * 2**30
    assert cli.parse_size("1TB") == 10**12
    assert cli.parse_rate("12.5GB/s") == 12.5e9
    assert cli.parse_rate("200Gb/s") == 25e9
    assert cli.parse_count("94M") == 94_000_000 and cli.parse_count("1.5B") == 1_500_000_000
    # exact decimals: in binary floats 4.1 * 1e6 is 4099999.9999999995 (refused as a count, 1 byte short as a size)
    assert cli.parse_count("4.1M") == 4_100_000 and cli.parse_count("2.3M") == 2_300_000
    assert cli.parse_size("4.1MB") == 4_100_000 and cli.parse_rate("0.7GB/s") == 0.7e9
    assert cli.parse_topology("16x8") == (16, 8)
    for bad in ("80XB", "fast", "-1GB"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.parse_size(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size("12GB/s")  # a rate is not a size
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_topology("16")


def test_cli_plans_criteo_and_writes_a_valid_plan(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    plan = _run_cli(["--tables", "criteo_kaggle", "--topology", "1x2", "--max-table-size", "1M",
                     "--time-limit", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert "imbalance" in text and "C3" in text and "per rank" in text
    loaded = ShardingPlan.from_json(out.read_text(), str(out))
    assert loaded.to_dict() == plan.to_dict()
    specs = [TableSpec(t.name, t.rows, t.dim) for t in loaded.tables]
    loaded.validate(2, specs)
    assert max(t.rows for t in loaded.tables) == 1_000_000 and {t.dim for t in loaded.tables} == {16}


def test_cli_synthetic_model_summarises_many_tables(capsys) -> None:
    plan = _run_cli(["--synthetic-tables", "60", "--rows", "2M", "--dim", "64", "--topology", "4x8",
                     "--hbm", "2GB", "--force-sharding", "row_wise", "--top", "5", "--time-limit", "1"])
    text = capsys.readouterr().out
    assert len(plan.tables) == 60 and {t.sharding for t in plan.tables} == {"row_wise"}
    assert "the 5 costliest of 60 tables" in text and "per node" in text and "slowest ranks" in text
    assert max(plan.cost["hbm_bytes_per_rank"]) <= 2 * 10**9


def test_cli_refuses_options_it_cannot_honour() -> None:
    """An explicit --dim 0 is an error, not the default dim; --synthetic-tables needs at least one table."""
    for argv, message in [
        (["--synthetic-tables", "2", "--rows", "10", "--dim", "0"], "field 'dim' must be a positive integer, got 0"),
        (["--tables", "criteo_kaggle", "--dim", "0"], "field 'dim' must be a positive integer, got 0"),
        (["--synthetic-tables", "0", "--rows", "10"], "--synthetic-tables: must be at least 1, got 0"),
        (["--synthetic-tables", "-3", "--rows", "10"], "--synthetic-tables: must be at least 1, got -3"),
    ]:
        with pytest.raises(PlanError, match=re.escape(message)):
            _run_cli(argv)


def test_cli_table_file_errors_name_file_line_and_field(tmp_path) -> None:
    f = tmp_path / "tables.json"
    f.write_text('[\n  {"name": "a", "rows": 100, "dim": 8},\n  {"name": "b", "rows": -5, "dim": 8}\n]\n')
    with pytest.raises(PlanError, match=r"tables.json, line 3, table 1: .*'rows'"):
        _run_cli(["--tables", str(f)])
    f.write_text('[{"name": "a", "rows": 100, "dim": 8, "hot": 1}]')
    with pytest.raises(PlanError, match=r"line 1, table 0: unknown field\(s\) \['hot'\]"):
        _run_cli(["--tables", str(f)])
    f.write_text('[{"name": "a", "rows": 100, "dim": 8, "pooling": 2.5, "access_counts": [5, 1]},\n'
                 ' {"name": "b", "rows": 50}]')
    plan = _run_cli(["--tables", str(f), "--dim", "4", "--topology", "1x2", "--time-limit", "1"])
    assert [(t.name, t.dim) for t in plan.tables] == [("a", 4), ("b", 4)]


# -- plan files for dist.plan (hand-written or from the planner) ------------------------------------------------
def _plan_file(tmp_path, tables: list[dict], **top) -> str:
    path = tmp_path / "my_plan.json"
    path.write_text(json.dumps({"world_size": 2, **top, "tables": tables}))
    return str(path)


def _entry(name: str, sharding: str, ranks, **more) -> dict:
    return {"name": name, "sharding": sharding, "ranks": ranks, **more}


@pytest.mark.parametrize(("tables", "top", "message"), [
    ([_entry("C1", "table_wise", [0.7]), _entry("C2", "table_wise", [1.9])], {},
     r"plan table 0 \('C1'\): field 'ranks' must be a non-empty list of integers, got \[0.7\]"),
    ([_entry("C1", "table_wise", [0]), _entry("C2", "row_wise", "10")], {},
     r"plan table 1 \('C2'\): field 'ranks' must be a list of ranks, got '10'"),
    ([_entry("C1", "table_wise", [0]), _entry("C2", "data_parallel", [1])], {},
     r"plan table 1 \('C2'\): field 'ranks': data_parallel must list every rank 0..1 in order, got \[1\]"),
    ([_entry("C1", "table_wise", [0]), _entry("C2", "table_wise", [])], {},
     r"plan table 1 \('C2'\): field 'ranks' must be a non-empty list of integers, got \[\]"),
    ([_entry("C1", "table_wise", [0]), _entry("C2", "column_wise", [0, 1, 0])], {},
     r"plan table 1 \('C2'\): field 'ranks': a rank appears twice"),
    ([_entry("C1", "table_wise", [2]), _entry("C2", "table_wise", [0])], {},
     r"plan table 0 \('C1'\): field 'ranks': rank\(s\) \[2\] out of range 0..1"),
    ([_entry("C1", "tablewise", [0]), _entry("C2", "table_wise", [0])], {},
     r"plan table 0 \('C1'\): field 'sharding': unknown sharding 'tablewise'"),
    ([_entry("C1", "table_wise", [0], rows="300"), _entry("C2", "table_wise", [0])], {},
     r"plan table 0 \('C1'\): field 'rows' must be a positive integer, got '300'"),
    ([_entry("C1", "table_wise", [0], memory_bytes_per_rank={"1": 10}), _entry("C2", "table_wise", [0])], {},
     r"plan table 0 \('C1'\): field 'memory_bytes_per_rank' names ranks \[1\]"),
    ([_entry("C1", "table_wise", [0], rank=[1]), _entry("C2", "table_wise", [0])], {},
     r"plan table 0 \('C1'\): unknown field\(s\) \['rank'\]"),
    ([_entry("C1", "table_wise", [0])], {}, r"no entry for table\(s\) \['C2'\]"),
    ([_entry("C1", "table_wise", [0]), _entry("C2", "table_wise", [0]), _entry("C9", "table_wise", [0])], {},
     r"plan table 2 \('C9'\): unknown table"),
    ([_entry("C1", "table_wise", [0]), _entry("C2", "table_wise", [0])], {"world_size": 4},
     r"field 'world_size': plan is for world size 4, running with 2"),
    ([_entry("C1", "table_wise", [0]), _entry("C2", "table_wise", [0])], {"world_size": "2"},
     r"field 'world_size' must be a positive integer, got '2'"),
    ([_entry("C1", "table_wise", [0]), _entry("C2", "table_wise", [0])], {"topology": {"nodes": 2}},
     r"field 'topology': plan topology has 2 x 8 = 16 ranks"),
])
def test_plan_file_errors_name_file_table_and_field(tmp_path, tables, top, message) -> None:
    from recstack.distributed.config import DistConfig
    from recstack.distributed.parallelize import placements_from_config

    path = _plan_file(tmp_path, tables, **top)
    with pytest.raises(PlanError, match=f"^{re.escape(path)}: .*{message}"):
        placements_from_config(DistConfig(plan=path), ["C1", "C2"], 2)


def test_plan_file_checked_against_the_table_sizes(tmp_path) -> None:
    """Rows and dim may be left out (they are the model's); where given they must match, and shard counts must
    split the tables. The sharded collection runs this check (``PlanPlacements.check``) before any collective."""
    from recstack.distributed.config import DistConfig
    from recstack.distributed.parallelize import placements_from_config

    sizes = [TableSpec("C1", 1, 8), TableSpec("C2", 300, 8)]
    ok = _plan_file(tmp_path, [_entry("C1", "row_wise", [0, 1]), _entry("C2", "column_wise", [1, 0], dim=8)])
    placements = placements_from_config(DistConfig(plan=ok), ["C1", "C2"], 2)
    placements.check(sizes)  # a hand-written plan may leave a row block empty (1 row over 2 ranks)
    assert list(placements) == [("row_wise", [0, 1]), ("column_wise", [1, 0])]
    for tables, message in [
        ([_entry("C1", "table_wise", [0]), _entry("C2", "table_wise", [1], rows=200)],
         r"plan table 1 \('C2'\): field 'rows' is 200 in the plan, the table is 300 x 8"),
        ([_entry("C1", "table_wise", [0], dim=16), _entry("C2", "table_wise", [1])],
         r"plan table 0 \('C1'\): field 'dim' is 16 in the plan, the table is 1 x 8"),
        ([_entry("C1", "table_wise", [0]), _entry("C2", "column_wise", [0, 1])], None),
    ]:
        path = _plan_file(tmp_path, tables)
        placements = placements_from_config(DistConfig(plan=path), ["C1", "C2"], 2)
        if message is None:
            placements.check(sizes)
            continue
        with pytest.raises(PlanError, match=f"^{re.escape(path)}: {message}"):
            placements.check(sizes)
    # Memory figures in a hand-written plan without a topology are not held against a default HBM size.
    big = _plan_file(tmp_path, [_entry("C1", "table_wise", [0], memory_bytes_per_rank={"0": 40 * 10**9}),
                                _entry("C2", "table_wise", [1])])
    placements_from_config(DistConfig(plan=big), ["C1", "C2"], 2).check(sizes)
    three = _plan_file(tmp_path, [_entry("C1", "table_wise", [0]), _entry("C2", "column_wise", [0, 1, 2])],
                       world_size=3)
    placements = placements_from_config(DistConfig(plan=three), ["C1", "C2"], 3)
    message = r"plan table 1 \('C2'\): field 'ranks': column_wise over 3 ranks needs dim divisible by 3, dim is 8"
    with pytest.raises(PlanError, match=f"^{re.escape(three)}: {message}"):
        placements.check(sizes)


def test_plan_for_another_node_split_names_the_table_row_wise_table(tmp_path) -> None:
    """A plan written for 1 x 4 ranks run as 2 nodes x 2: its table_row_wise table spans both nodes of the job,
    an error naming the plan file, the table and what to plan for (not the sharding's own bare message)."""
    from recstack.distributed.config import DistConfig
    from recstack.distributed.parallelize import placements_from_config

    topo = {"nodes": 1, "devices_per_node": 4}
    path = _plan_file(tmp_path, [_entry("C1", "table_wise", [3]), _entry("C2", "table_row_wise", [0, 1, 2, 3])],
                      world_size=4, topology=topo)
    assert list(placements_from_config(DistConfig(plan=path, ranks_per_node=4), ["C1", "C2"], 4))[1] == (
        "table_row_wise", [0, 1, 2, 3])
    message = (r"plan table 1 \('C2'\): field 'ranks': table_row_wise ranks \[0, 1, 2, 3\] span nodes \[0, 1\] of "
               r"this job \(2 ranks per node; the plan is for 1 x 4\).* plan again with --topology 2x2")
    with pytest.raises(PlanError, match=f"^{re.escape(path)}: {message}"):
        placements_from_config(DistConfig(plan=path, ranks_per_node=2), ["C1", "C2"], 4)
    inside = _plan_file(tmp_path, [_entry("C1", "table_wise", [3]), _entry("C2", "table_row_wise", [2, 3])],
                        world_size=4, topology=topo)  # within one node of the job too: runs
    assert list(placements_from_config(DistConfig(plan=inside, ranks_per_node=2), ["C1", "C2"], 4))[1] == (
        "table_row_wise", [2, 3])


def test_planner_plan_file_is_read_for_training(tmp_path) -> None:
    from recstack.distributed.config import DistConfig
    from recstack.distributed.parallelize import placements_from_config

    plan, tables = _small_plan()
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    placements = placements_from_config(DistConfig(plan=str(path)), [t.name for t in tables], 4)
    placements.check(tables)
    assert list(placements) == [(t.sharding, t.ranks) for t in plan.tables]
