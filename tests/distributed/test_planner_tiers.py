"""Storage tiers in the sharding planner: tiered plans within every budget, the cache-miss cost term, the plan
file's ``storage`` field (old files unchanged, malformed or overcommitting ones refused with the field, table and
rank named), and ``recstack plan`` with the tier flags as a real process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recstack.distributed.config import DistConfig
from recstack.distributed.parallelize import placements_from_config
from recstack.distributed.planner.cost import TERMS, CostConfig, CostModel
from recstack.distributed.planner.hit_rate import estimate_cache
from recstack.distributed.planner.inputs import PlanError, TableSpec, Topology
from recstack.distributed.planner.partition import plan_sharding
from recstack.distributed.planner.plan import ShardingPlan
from recstack.distributed.planner.storage import ShardStorage, StorageError, TierBudgets
from recstack.distributed.sharding import shard_blocks
from recstack.errors import ConfigError

GB = 10**9
ROOT = Path(__file__).resolve().parents[2]
# 12 tables of 2M x 64 (fp32 + Adagrad: 520 MB each, 6.2 GB in all) on 2 x 2 ranks of 500 MB device memory
TABLES = [TableSpec(f"t{i}", 2_000_000, 64, pooling=float(1 + i % 3)) for i in range(12)]


def _topo(hbm: int = 500 * 10**6, ddr: int = 2 * GB, ssd: int = 0) -> Topology:
    return Topology(2, 2, hbm_bytes=hbm, ddr_bytes=ddr, ssd_bytes=ssd)


def _used(plan: ShardingPlan, tables: list[TableSpec]) -> dict[str, np.ndarray]:
    """Bytes per budget per rank, summed from the shards' storage (not from the plan's own cost section)."""
    out = {b: np.zeros(plan.world_size, dtype=np.int64) for b in ("device", "host", "ssd")}
    specs = {t.name: t for t in tables}
    for e in plan.tables:
        t = specs[e.name]
        for r, (r0, r1, c0, c1), st in zip(e.ranks, shard_blocks(e.sharding, t.rows, t.dim, len(e.ranks)),
                                           e.shard_storage(), strict=True):
            rb = (c1 - c0) * 4 + 4
            if st is None:
                out["device"][r] += (r1 - r0) * rb + ((r1 - r0) * (c1 - c0) * 4 if e.sharding == "data_parallel"
                                                      else 0)
            else:
                assert 1 <= st.cache_rows < r1 - r0
                out["device"][r] += st.cache_rows * rb
                out["host" if st.tier == "host-cached" else "ssd"][r] += (r1 - r0) * rb
    return out


def test_tables_over_device_memory_get_tiers_within_every_budget() -> None:
    topo = _topo(ssd=4 * GB)  # per rank: 500 MB device, 1 GB host, 2 GB SSD: 6.2 GB needs all three
    with pytest.raises(PlanError, match="need at least"):
        plan_sharding(TABLES, topo, 512, time_limit_s=1)  # device-only, as before
    plan = plan_sharding(TABLES, topo, 512, time_limit_s=1, tiers=True)
    plan.validate(4, TABLES)  # includes the tier budgets of the plan's own topology
    used, budgets = _used(plan, TABLES), topo.budgets()
    assert (used["device"] <= budgets.device).all() and (used["host"] <= budgets.host).all()
    assert (used["ssd"] <= budgets.ssd).all()
    tiers = {st.tier for e in plan.tables for st in e.storage.values()}
    assert tiers == {"host-cached", "ssd-cached"}  # host memory alone (4 GB) cannot hold 6.2 GB
    assert used["device"].min() > 0.9 * budgets.device  # free device memory went to the caches
    assert plan.cost["hbm_bytes_per_rank"] == used["device"].tolist()
    assert plan.cost["host_bytes_per_rank"] == used["host"].tolist()
    assert plan.cost["ssd_bytes_per_rank"] == used["ssd"].tolist()
    assert max(plan.cost["breakdown"]["cache_miss"]) > 0
    again = ShardingPlan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()


def test_more_host_memory_never_raises_the_predicted_step() -> None:
    steps = []
    for ddr in (1 * GB, 2 * GB, 3 * GB, 4 * GB, 8 * GB):
        plan = plan_sharding(TABLES, _topo(ddr=ddr, ssd=8 * GB), 512, time_limit_s=1, tiers=True)
        steps.append(plan.cost["max"])
    assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:], strict=False)), steps
    assert steps[-1] < steps[0]  # host memory replaced the slower SSD


def test_plans_that_fit_in_device_memory_are_unchanged() -> None:
    topo = Topology(2, 2, hbm_bytes=4 * GB, ddr_bytes=GB, ssd_bytes=GB)
    device = plan_sharding(TABLES, topo, 512, time_limit_s=1)
    tiered = plan_sharding(TABLES, topo, 512, time_limit_s=1, tiers=True)
    assert tiered.to_dict() == device.to_dict()
    assert not any(e.storage for e in tiered.tables) and "storage" not in json.loads(tiered.to_json())["tables"][0]
    assert max(device.cost["breakdown"]["cache_miss"]) == 0


def test_cache_miss_term_follows_the_hit_rate_model() -> None:
    topo, table = _topo(ssd=GB), TableSpec("t", 1_000_000, 32, pooling=2.0)
    model = CostModel(topo, 256, CostConfig(cache_policy="lfu", zipf_exponent=0.9))
    storage = [ShardStorage("host-cached", 50_000), None, ShardStorage("ssd-cached", 10_000), None]
    est = model.estimate(table, "row_wise", 4, storage)
    device = model.estimate(table, "row_wise", 4)
    rb = 32 * 4 + 4
    for j, st in enumerate(storage):
        miss = est.terms[j, TERMS.index("cache_miss")]
        if st is None:
            assert miss == 0 and est.hbm[j] == device.hbm[j] and np.isnan(est.hit_rate[j])
            continue
        c = estimate_cache(1_000_000, 0.9, st.cache_rows, 256 * 4 * 2.0, "lfu", fraction=0.25)
        per_byte = 1 / topo.pcie_bw + (1 / topo.ssd_bw if st.tier == "ssd-cached" else 0)
        assert miss == pytest.approx(c.misses * 2 * rb * per_byte, rel=1e-12)
        assert est.hit_rate[j] == pytest.approx(c.hit_rate)
        assert est.hbm[j] == st.cache_rows * rb
        assert (est.host if st.tier == "host-cached" else est.ssd)[j] == 250_000 * rb
    others = [i for i, name in enumerate(TERMS) if name != "cache_miss"]
    assert np.array_equal(est.terms[:, others], device.terms[:, others])
    with pytest.raises(PlanError, match="data_parallel tables stay on the device"):
        model.estimate(table, "data_parallel", 4, [ShardStorage("host-cached", 10)] * 4)


# -- plan files ------------------------------------------------------------------------------------------
OLD_PLAN = {  # a plan file as the planner wrote it before storage tiers
    "version": 1, "world_size": 2,
    "topology": {"nodes": 1, "devices_per_node": 2, "hbm_bytes": 32 * GB, "ddr_bytes": 128 * GB,
                 "intra_bw": 600e9, "inter_bw": 12.5e9, "hbm_bw": 900e9},
    "batch_size_per_rank": 256,
    "tables": [{"name": "C1", "rows": 1000, "dim": 8, "sharding": "row_wise", "ranks": [0, 1],
                "memory_bytes_per_rank": {"0": 18000, "1": 18000}},
               {"name": "C2", "rows": 10, "dim": 8, "sharding": "data_parallel", "ranks": [0, 1],
                "memory_bytes_per_rank": {"0": 680, "1": 680}}],
    "cost": {"max": 1e-5},
}
SIZES = [TableSpec("C1", 1000, 8), TableSpec("C2", 10, 8)]


def _write(tmp_path: Path, plan: dict) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def _with_storage(storage: object, table: int = 0, **topology: int) -> dict:
    plan = json.loads(json.dumps(OLD_PLAN))
    plan["tables"][table]["storage"] = storage
    plan["topology"].update(topology)
    return plan


def test_old_plan_files_load_unchanged(tmp_path) -> None:
    plan = ShardingPlan.from_json(json.dumps(OLD_PLAN))
    plan.validate(2, SIZES)
    assert plan.topology.ssd_bytes == 0 and all(not e.storage for e in plan.tables)
    assert plan.to_dict()["tables"] == OLD_PLAN["tables"]
    placements = placements_from_config(DistConfig(plan=_write(tmp_path, OLD_PLAN)), ["C1", "C2"], 2)
    placements.check(SIZES, TierBudgets(device=GB, host=GB, ssd=0))
    assert list(placements) == [("row_wise", [0, 1]), ("data_parallel", [0, 1])]
    assert placements.storage == [[None, None], [None, None]]


def test_storage_field_is_read_for_training(tmp_path) -> None:
    path = _write(tmp_path, _with_storage({"1": {"tier": "ssd-cached", "cache_rows": 64}}, ssd_bytes=10**6))
    placements = placements_from_config(DistConfig(plan=path), ["C1", "C2"], 2)
    placements.check(SIZES)
    assert placements.storage[0] == [None, ShardStorage("ssd-cached", 64)]
    assert ShardingPlan.from_json(Path(path).read_text()).table("C1").shard_storage() == placements.storage[0]


@pytest.mark.parametrize("storage,table,message", [
    ({"0": {"tier": "gpu", "cache_rows": 5}}, 0, r"field 'storage': rank 0: 'tier' must be one of host-cached, "
                                                 r"ssd-cached"),
    ({"1": {"tier": "host-cached", "cache_rows": 0}}, 0, r"field 'storage': rank 1: 'cache_rows' must be an "
                                                         r"integer of at least one row, got 0"),
    ({"1": {"tier": "host-cached", "cache_rows": "9"}}, 0, r"rank 1: 'cache_rows' must be an integer"),
    ({"0": {"tier": "host-cached"}}, 0, r"field 'storage': rank 0: missing field 'cache_rows'"),
    ({"0": {"tier": "host-cached", "cache_rows": 5, "ways": 8}}, 0, r"rank 0: unknown field\(s\) \['ways'\]"),
    ({"x": {"tier": "host-cached", "cache_rows": 5}}, 0, r"field 'storage': key 'x' is not a rank"),
    ([{"tier": "host-cached", "cache_rows": 5}], 0, r"field 'storage': must be an object"),
    ({"3": {"tier": "host-cached", "cache_rows": 5}}, 0, r"plan table 0 \('C1'\): field 'storage': rank\(s\) \[3\] "
                                                         r"hold no shard of this table"),
    ({"0": {"tier": "host-cached", "cache_rows": 5}}, 1, r"plan table 1 \('C2'\): field 'storage': data_parallel "
                                                         r"tables stay on the device"),
    ({"0": {"tier": "host-cached", "cache_rows": 500}}, 0, r"plan table 0 \('C1'\): field 'storage': rank 0: "
                                                           r"'cache_rows' 500 is not below the shard's 500 rows"),
])
def test_malformed_storage_names_the_field_table_and_rank(tmp_path, storage, table, message) -> None:
    path = _write(tmp_path, _with_storage(storage, table))
    with pytest.raises(PlanError, match=f"^{re.escape(path)}: .*{message}") as err:
        placements_from_config(DistConfig(plan=path), ["C1", "C2"], 2).check(SIZES)
    assert isinstance(err.value, ConfigError)  # the command line prints it as one line
    if table == 0 and "key" not in message and "must be an object" not in message:
        assert "C1" in str(err.value)


def test_overcommitted_tiers_name_the_table_rank_and_budget(tmp_path) -> None:
    # C1's 500-row shard on rank 1 is 18,000 bytes on SSD; the plan's hosts have 20,000 bytes of SSD for 2 ranks
    path = _write(tmp_path, _with_storage({"1": {"tier": "ssd-cached", "cache_rows": 10}}, ssd_bytes=20_000))
    message = (r"plan table 0 \('C1'\): rank 1 holds 18.0 KB \(18,000 bytes\) in SSD with this table, over its "
               r"ssd budget of 10.0 KB \(10,000 bytes\) \(20.0 KB per host / 2 ranks\)")
    with pytest.raises(PlanError, match=f"^{re.escape(path)}: field 'storage': {message}"):
        placements_from_config(DistConfig(plan=path), ["C1", "C2"], 2)
    with pytest.raises(PlanError, match=f"field 'storage': {message}"):
        ShardingPlan.from_json(Path(path).read_text()).validate(2, SIZES)
    fits = _write(tmp_path, _with_storage({"1": {"tier": "host-cached", "cache_rows": 10}}))
    placements = placements_from_config(DistConfig(plan=fits), ["C1", "C2"], 2)
    placements.check(SIZES)  # 128 GB of host memory per host in the plan's topology
    # budgets the job gives (``[memory]`` under torchrun) are checked against the same shards
    with pytest.raises(PlanError, match=r"plan table 0 \('C1'\): rank 1 holds 18.0 KB .* in host memory with this "
                                        r"table, over its host budget of 1.0 KB"):
        placements.check(SIZES, TierBudgets(device=GB, host=1000, ssd=0))
    with pytest.raises(PlanError, match=r"plan table 0 \('C1'\): rank 0 holds 18.0 KB .* in device memory"):
        placements.check(SIZES, TierBudgets(device=10_000, host=GB))
    # SGD keeps no state per row: 500 rows x 8 x 4 = 16,000 bytes fit a 17 KB host budget that Adagrad's do not
    placements.check(SIZES, TierBudgets(device=GB, host=17_000), state_bytes=0)
    with pytest.raises(PlanError, match=r"rank 1 holds 18.0 KB"):
        placements.check(SIZES, TierBudgets(device=GB, host=17_000))


def test_bad_budgets_are_errors() -> None:
    with pytest.raises(PlanError, match="topology: ssd_bytes must be a non-negative number, got -1"):
        Topology(ssd_bytes=-1)
    with pytest.raises(PlanError, match="topology: pcie_bw must be a positive number, got 0"):
        Topology(pcie_bw=0)
    with pytest.raises(PlanError, match="topology: ddr_bytes must be a non-negative number, got -5"):
        Topology(ddr_bytes=-5)
    ssd_only = plan_sharding(TABLES, _topo(ddr=0, ssd=8 * GB), 512, time_limit_s=1, tiers=True)
    assert {st.tier for e in ssd_only.tables for st in e.storage.values()} == {"ssd-cached"}
    with pytest.raises(StorageError, match="host budget must be a non-negative number of bytes"):
        TierBudgets(host=-5)
    with pytest.raises(PlanError, match=r"each of the 4 ranks has device 500.0 MB, host 1.0 GB, SSD 0 B"):
        plan_sharding(TABLES, _topo(), 512, time_limit_s=1, tiers=True)  # 6.2 GB > 4 x 1.5 GB
    with pytest.raises(PlanError, match="cache policy 'fifo'"):
        CostConfig(cache_policy="fifo")


# -- the command line, as a user runs it -----------------------------------------------------------------
def _recstack(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "recstack", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_cli_plans_with_tier_flags(tmp_path) -> None:
    out = tmp_path / "tiers.json"
    r = _recstack("plan", "--synthetic-tables", "12", "--rows", "2M", "--dim", "64", "--topology", "2x2",
                  "--batch-size", "512", "--hbm", "500MB", "--ddr", "2GB", "--ssd", "4GB", "--cache-policy", "lfu",
                  "--zipf", "1.0", "--pcie-bw", "16GB/s", "--time-limit", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "hit rate min / mean / max" in r.stdout and "host-cached" in r.stdout and "ssd-cached" in r.stdout
    assert "budgets per rank: device 500.0 MB, host 1.0 GB, SSD 2.0 GB" in r.stdout
    plan = ShardingPlan.from_json(out.read_text(), str(out))
    specs = [TableSpec(f"t{i}", 2_000_000, 64) for i in range(12)]
    plan.validate(4, specs)
    assert plan.topology.pcie_bw == 16e9 and plan.cost["config"]["cache_policy"] == "lfu"
    assert plan.cost["config"]["zipf_exponent"] == 1.0
    placements = placements_from_config(DistConfig(plan=str(out)), [t.name for t in specs], 4)
    placements.check(specs, plan.topology.budgets())
    assert any(st is not None for shards in placements.storage for st in shards)


def test_cli_without_tier_flags_stays_device_only_and_errors_are_one_line() -> None:
    r = _recstack("plan", "--synthetic-tables", "12", "--rows", "2M", "--dim", "64", "--topology", "2x2",
                  "--hbm", "500MB")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "need at least" in r.stderr, r.stderr
    r = _recstack("plan", "--synthetic-tables", "12", "--rows", "2M", "--dim", "64", "--topology", "2x2",
                  "--hbm", "500MB", "--ddr", "1GB")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert re.search(r"each of the 4 ranks has device 500.0 MB, host 500.0 MB, SSD 0 B", r.stderr), r.stderr


def test_cli_zipf_from_prepared_data(tmp_path) -> None:
    data = tmp_path / "synth"
    r = _recstack("data", "synth", "--out", str(data), "--rows", "20000", "--set", "zipf_exponent=1.3",
                  "--set", "table_sizes=[20000,30000]")
    assert r.returncode == 0, r.stderr
    r = _recstack("data", "inspect", str(data))
    assert r.returncode == 0 and "Zipf 1.2" in r.stdout, r.stdout  # the fit lands a little below 1.3
    out = tmp_path / "plan.json"
    r = _recstack("plan", "--tables", str(data), "--zipf-from", str(data), "--topology", "1x2", "--hbm", "1MB",
                  "--batch-size", "256", "--ddr", "1GB", "--time-limit", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    low = _recstack("plan", "--tables", str(data), "--zipf", "0.5", "--topology", "1x2", "--hbm", "1MB",
                    "--batch-size", "256", "--ddr", "1GB", "--time-limit", "1")
    assert low.returncode == 0, low.stderr
    # hotter ids (the fitted ~1.2 against 0.5) give the same caches higher hit rates
    fitted, flat = (float(re.search(r"host-cached\s+\d+\s+\S+\s+[\d.]+ / ([\d.]+) /", x.stdout).group(1))
                    for x in (r, low))
    assert fitted > flat


def test_table_file_zipf_sets_each_tables_hit_rate(tmp_path) -> None:
    from recstack.cli.plan import load_table_file

    f = tmp_path / "tables.json"
    f.write_text('[{"name": "hot", "rows": 1000000, "dim": 16, "zipf": 1.3},\n'
                 ' {"name": "flat", "rows": 1000000, "dim": 16, "zipf": 0.3}]')
    specs = load_table_file(f)
    assert [t.zipf for t in specs] == [1.3, 0.3]
    plan = plan_sharding(specs, Topology(1, 2, hbm_bytes=20 * 10**6, ddr_bytes=GB), 2048, time_limit_s=1,
                         tiers=True)
    model = CostModel(plan.topology, 2048)
    hot, flat = (model.estimate(t, plan.table(t.name).sharding, len(plan.table(t.name).ranks),
                                plan.table(t.name).shard_storage()).hit_rate for t in specs)
    assert np.nanmin(hot) > np.nanmax(flat)
    f.write_text('[{"name": "x", "rows": 10, "dim": 4, "zipf": -1}]')
    with pytest.raises(PlanError, match=r"line 1, table 0: table 'x': field 'zipf' must be a non-negative number"):
        load_table_file(f)
