"""``recstack plan``: build table specs and a topology from the command line, plan, print, save.

Sizes and bandwidths take human units: ``80GB`` (decimal), ``64GiB`` (binary), ``12.5GB/s``, ``200Gb/s``
(lower-case b = bits). Row counts take K, M, B/G and T suffixes (``94M``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from decimal import Decimal
from pathlib import Path

from recstack.distributed.planner.cost import OPTIMIZER_STATE_BYTES, CostConfig, CostModel
from recstack.distributed.planner.hit_rate import POLICIES, SYNTH_ZIPF_EXPONENT
from recstack.distributed.planner.inputs import PlanError, TableSpec, Topology
from recstack.distributed.planner.partition import plan_sharding
from recstack.distributed.planner.plan import ShardingPlan, parse_json
from recstack.distributed.planner.report import format_seconds, render_plan
from recstack.distributed.sharding import SHARDING_TYPES
from recstack.io import atomic_write_text, check_writable, read_text

NAMED_TABLES = {"criteo_kaggle": 16, "criteo_terabyte": 64}  # name -> DLRM reference dim (bench/*.sh)
SYNTHETIC_DIM = 128
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
# Bytes a codec adds to every row it sends (recstack.compression.base: fp8 keeps one fp32 scale per row,
# int8 an fp32 min and scale); kept here so that planning does not import torch.
CODEC_ROW_BYTES = {"fp32": 0, "fp16": 0, "bf16": 0, "fp8": 4, "int8": 8}
_PREFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kmgtp]i?)?(b|bit|bits)?(/s|ps)?\s*", re.IGNORECASE)
_COUNT = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _parse_quantity(text: str, rate: bool) -> Decimal:
    """Bytes (or bytes/s) as an exact decimal: '4.1MB' is 4,100,000 bytes, where binary floats give 4,099,999."""
    m = _QUANTITY.fullmatch(text)
    if not m or (m.group(4) and not rate):
        kind = "bandwidth like 12.5GB/s" if rate else "size like 80GB"
        raise argparse.ArgumentTypeError(f"{text!r} is not a {kind}")
    value = Decimal(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
    bits = m.group(3) not in (None, "B")  # 'b', 'bit', 'bits': network gear is sold in bits
    return value / 8 if bits else value


def parse_bytes(text: str, rate: bool = False) -> float:
    """'80GB' -> 8e10; '64GiB' -> 2**36; with ``rate``: '12.5GB/s' -> 1.25e10, '200Gb/s' -> 2.5e10."""
    return float(_parse_quantity(text, rate))


def parse_rate(text: str) -> float:
    return parse_bytes(text, rate=True)


def parse_size(text: str) -> int:
    return int(_parse_quantity(text, rate=False))


def parse_count(text: str) -> int:
    """'94M' -> 94_000_000; '1.5B' -> 1_500_000_000; '10000000' -> 10_000_000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kmbgt]?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count like 94M")
    value = Decimal(m.group(1)) * _COUNT[m.group(2).lower()]  # exact: 4.1M is whole, 4.1 * 1e6 in floats is not
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(value)


def parse_topology(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not NODESxDEVICES, e.g. 16x8")
    return int(m.group(1)), int(m.group(2))


def load_table_file(path: str | Path, dim: int | None = None, pooling: float | None = None) -> list[TableSpec]:
    """A JSON list of {"name", "rows", "dim", "pooling", "access_counts", "zipf"} objects ("dim" may come from
    ``dim``, "pooling" defaults to ``pooling`` or 1, "zipf" (the ids' Zipf exponent) to --zipf). Errors name
    the file, line and field."""
    path = Path(path)
    text = read_text(path, PlanError)
    data = parse_json(text, str(path), list)
    known = {"name", "rows", "dim", "pooling", "access_counts", "zipf"}
    specs = []
    for i, (item, line) in enumerate(zip(data, _element_lines(text), strict=True)):
        where = f"{path}, line {line}, table {i}"
        if not isinstance(item, dict):
            raise PlanError(f"{where}: expected an object, got {type(item).__name__}")
        unknown = sorted(set(item) - known)
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {unknown} (known: {sorted(known)})")
        for key in ("name", "rows"):
            if key not in item:
                raise PlanError(f"{where}: missing field '{key}'")
        if "dim" not in item and dim is None:
            raise PlanError(f"{where}: missing field 'dim' (or give --dim)")
        counts = item.get("access_counts")
        try:
            specs.append(TableSpec(item["name"], item["rows"], dim if dim is not None else item["dim"],
                                   item.get("pooling", pooling if pooling is not None else 1.0),
                                   tuple(counts) if isinstance(counts, list) else counts, item.get("zipf")))
        except PlanError as e:
            raise PlanError(f"{where}: {e}") from e
    return specs


def _element_lines(text: str) -> list[int]:
    """Line of each top-level element of a JSON list (text already parsed once, so it is valid)."""
    decoder = json.JSONDecoder()
    lines: list[int] = []
    i = text.index("[") + 1
    while True:
        while text[i] in " \t\r\n,":
            i += 1
        if text[i] == "]":
            return lines
        lines.append(text.count("\n", 0, i) + 1)
        i = decoder.raw_decode(text, i)[1]


def build_tables(args: argparse.Namespace) -> list[TableSpec]:
    pooling = args.pooling if args.pooling is not None else 1.0

    def dim_or(default: int) -> int:  # an explicit --dim 0 is checked by TableSpec, not replaced by the default
        return args.dim if args.dim is not None else default

    if args.synthetic_tables is not None:
        if args.tables or args.rows is None:
            raise PlanError("--synthetic-tables N needs --rows R (and no --tables)")
        if args.synthetic_tables < 1:
            raise PlanError(f"--synthetic-tables: must be at least 1, got {args.synthetic_tables}")
        dim = dim_or(SYNTHETIC_DIM)
        specs = [TableSpec(f"t{i}", args.rows, dim, pooling) for i in range(args.synthetic_tables)]
    elif args.tables in NAMED_TABLES:
        from recstack.data.prepare.criteo import KAGGLE_CARDINALITIES, SPARSE_NAMES, TERABYTE_CARDINALITIES

        sizes = KAGGLE_CARDINALITIES if args.tables == "criteo_kaggle" else TERABYTE_CARDINALITIES
        dim = dim_or(NAMED_TABLES[args.tables])
        specs = [TableSpec(n, r, dim, pooling) for n, r in zip(SPARSE_NAMES, sizes, strict=True)]
    elif args.tables and (Path(args.tables) / "meta.json").is_file():  # a prepared data set: one table each
        from recstack.data.prepared_dataset import PreparedDataset

        ds = PreparedDataset(args.tables)
        table_rows = dict(zip(ds.table_names, ds.table_sizes, strict=True))
        specs = [TableSpec(name, rows, dim_or(16), pooling) for name, rows in table_rows.items()]
    elif args.tables:
        specs = load_table_file(args.tables, args.dim, args.pooling)
    else:
        raise PlanError(f"give --tables ({' | '.join(NAMED_TABLES)} | FILE.json) or --synthetic-tables N")
    if args.max_table_size:  # hashing into fewer rows scrambles a histogram over rows: capped tables go uniform
        specs = [TableSpec(t.name, min(t.rows, args.max_table_size), t.dim, t.pooling,
                           t.access_counts if t.rows <= args.max_table_size else None) for t in specs]
    if args.dynamic_capacity:
        specs = _dynamic(specs, args.dynamic_capacity, args.dynamic_tables)
    if args.qr_collisions:
        specs = _qr_split(specs, args.qr_collisions, args.qr_threshold)
    return specs


def _dynamic(specs: list[TableSpec], capacity: int, tables: str | None) -> list[TableSpec]:
    """The tables of ``model.dynamic_ids``: each dynamic table (``tables``, comma-separated; None: all) holds
    ``capacity`` rows whatever its id range, its rows in no particular order (no histogram over rows)."""
    if capacity < 2:
        raise PlanError(f"--dynamic-capacity: must be >= 2 (row 0 is the default row), got {capacity}")
    names = set(tables.split(",")) if tables else {t.name for t in specs}
    unknown = sorted(names - {t.name for t in specs})
    if unknown:
        raise PlanError(f"--dynamic-tables: no table {unknown[0]!r} (tables: {', '.join(t.name for t in specs)})")
    return [TableSpec(t.name, capacity, t.dim, t.pooling) if t.name in names else t for t in specs]


def _qr_split(specs: list[TableSpec], collisions: int, threshold: int) -> list[TableSpec]:
    """The tables a model with ``model.qr_collisions`` holds: each split table as its quotient table (same
    name; i // m keeps the histogram over row ranges) and, after all tables, its ``<name>_rem`` table (m
    rows; ids modulo m taken as uniform), in the order ``recstack.embedding.qr`` builds them."""
    from recstack.embedding.qr import REMAINDER_SUFFIX, split_rows

    if collisions < 2:
        raise PlanError(f"--qr-collisions: must be >= 2, got {collisions}")
    out, remainders = [], []
    for t in specs:
        rows = split_rows(t.rows, collisions, threshold)
        if rows is None:
            out.append(t)
            continue
        out.append(TableSpec(t.name, rows[0], t.dim, t.pooling, t.access_counts))
        remainders.append(TableSpec(t.name + REMAINDER_SUFFIX, rows[1], t.dim, t.pooling))
    return out + remainders


def _with_zipf(specs: list[TableSpec], path: str) -> list[TableSpec]:
    """Each table's Zipf exponent from the value counts of a prepared data set (``inspect_prepared``)."""
    if not (Path(path) / "meta.json").is_file():
        raise PlanError(f"--zipf-from {path}: not a prepared data directory (no meta.json)")
    from recstack.data.prepare.inspect import inspect_prepared

    fitted = {t["name"]: t["zipf"] for t in inspect_prepared(path).tables if t.get("zipf") is not None}
    return [dataclasses.replace(t, zipf=fitted[t.name]) if t.name in fitted else t for t in specs]


def _constraints(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        name, sep, kinds = item.partition("=")
        if not sep or not name or not kinds:
            raise PlanError(f"--constraint {item!r}: expected TABLE=TYPE[,TYPE...]")
        out[name] = kinds.split(",")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="shard embedding tables over ranks (load-balancing planner)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tables")
    g.add_argument("--tables", help=f"{' | '.join(NAMED_TABLES)} | FILE.json (a list of table specs) | a prepared "
                                    "data directory")
    g.add_argument("--synthetic-tables", type=int, metavar="N",
                   help="N tables of --rows x --dim (a hypothetical model)")
    g.add_argument("--rows", type=parse_count, help="rows of each synthetic table, e.g. 94M")
    g.add_argument("--dim", type=int, help=f"embedding dim for all tables (default: criteo_kaggle "
                   f"{NAMED_TABLES['criteo_kaggle']}, criteo_terabyte {NAMED_TABLES['criteo_terabyte']}, "
                   f"synthetic {SYNTHETIC_DIM}, else the file's)")
    g.add_argument("--max-table-size", type=parse_count, help="cap every table at this many rows")
    g.add_argument("--pooling", type=float, help="mean ids per sample (default 1; a file's own values win)")
    g.add_argument("--dynamic-capacity", type=parse_count, default=0, metavar="N",
                   help="plan dynamic id tables (model.dynamic_ids) at their capacity of N rows each, "
                        "row_wise over every rank in order (0: off)")
    g.add_argument("--dynamic-tables", metavar="NAMES", help="the dynamic tables, comma-separated (default: all)")
    g.add_argument("--qr-collisions", type=int, default=0, metavar="M",
                   help="plan the quotient-remainder tables of model.qr_collisions = M (0: off)")
    g.add_argument("--qr-threshold", type=int, default=200, help="tables of more rows are split (200)")
    g = p.add_argument_group("cluster")
    g.add_argument("--topology", type=parse_topology, default=(1, 8), metavar="NODESxDEVICES",
                   help="e.g. 16x8 (default 1x8)")
    g.add_argument("--batch-size", type=int, default=2048, help="batch per rank (default 2048)")
    g.add_argument("--hbm", type=parse_size, default=Topology.hbm_bytes, help="device memory per rank (32GB)")
    g.add_argument("--ddr", type=parse_size, help="host memory per node, split evenly between its ranks (default "
                   "128GB). Giving --ddr or --ssd lets tables that do not fit in device memory keep shards in host "
                   "memory or on SSD behind device caches; without either, plans are device-only and the DDR size "
                   "is only recorded")
    g.add_argument("--ssd", type=parse_size, help="SSD per node for ssd-cached shards, split evenly between its "
                   "ranks (default none)")
    g.add_argument("--pcie-bw", type=parse_rate, default=Topology.pcie_bw,
                   help="host<->device bandwidth per device, an assumption of the cost model (25GB/s)")
    g.add_argument("--ssd-bw", type=parse_rate, default=Topology.ssd_bw,
                   help="SSD bandwidth per rank, an assumption of the cost model (2GB/s)")
    g.add_argument("--intra-bw", type=parse_rate, default=Topology.intra_bw, help="per device in a node (600GB/s)")
    g.add_argument("--inter-bw", type=parse_rate, default=Topology.inter_bw, help="per device across nodes (12.5GB/s)")
    g.add_argument("--hbm-bw", type=parse_rate, default=Topology.hbm_bw, help="device memory bandwidth (900GB/s)")
    g = p.add_argument_group("model and search")
    g.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), default="rowwise_adagrad")
    g.add_argument("--weight-dtype", choices=["fp32", "fp16"], default="fp32")
    g.add_argument("--forward-codec", choices=sorted(ELEMENT_BYTES), default="fp32", help="all-to-all of outputs")
    g.add_argument("--backward-codec", choices=sorted(ELEMENT_BYTES), default="fp32", help="all-to-all of grads")
    g.add_argument("--cache-policy", choices=POLICIES, default="lru", help="device caches of tiered shards (lru)")
    g.add_argument("--zipf", type=float, default=SYNTH_ZIPF_EXPONENT, metavar="S",
                   help=f"Zipf exponent of the ids, for cache hit rates (default {SYNTH_ZIPF_EXPONENT}: the synthetic "
                        "generator's)")
    g.add_argument("--zipf-from", metavar="PREPARED_DIR",
                   help="per-table Zipf exponents fitted to a prepared data set's value counts (`recstack data "
                        "inspect` reports them); tables it does not name take --zipf")
    g.add_argument("--force-sharding", choices=SHARDING_TYPES, help="use this sharding type for every table")
    g.add_argument("--constraint", action="append", default=[], metavar="TABLE=TYPE[,TYPE]",
                   help="sharding type(s) one table may use (repeatable)")
    g.add_argument("--min-column-dim", type=int, default=8, help="narrowest column block proposed (8)")
    g.add_argument("--time-limit", type=float, default=5.0, help="seconds the search may take (5)")
    g.add_argument("--top", type=int, default=30, help="tables listed in full before summarising (30)")
    g.add_argument("--out", help="write the plan as JSON here")


def run(args: argparse.Namespace) -> ShardingPlan:
    if args.out:  # before the (long) planning
        check_writable(args.out, directory=False)
    t0 = time.perf_counter()
    tables = build_tables(args)
    if args.zipf_from:
        tables = _with_zipf(tables, args.zipf_from)
    nodes, devices = args.topology
    tiers = args.ddr is not None or args.ssd is not None
    topology = Topology(nodes, devices, args.hbm, Topology.ddr_bytes if args.ddr is None else args.ddr,
                        args.intra_bw, args.inter_bw, args.hbm_bw, args.ssd or 0, args.pcie_bw, args.ssd_bw)
    config = CostConfig(weight_bytes=ELEMENT_BYTES[args.weight_dtype], fwd_comm_bytes=ELEMENT_BYTES[args.forward_codec],
                        bwd_comm_bytes=ELEMENT_BYTES[args.backward_codec], optimizer=args.optimizer,
                        fwd_row_bytes=CODEC_ROW_BYTES[args.forward_codec],
                        bwd_row_bytes=CODEC_ROW_BYTES[args.backward_codec], cache_policy=args.cache_policy,
                        zipf_exponent=args.zipf)
    dynamic = (args.dynamic_tables.split(",") if args.dynamic_tables else [t.name for t in tables]
               ) if args.dynamic_capacity else []
    if dynamic and args.dynamic_capacity % (nodes * devices):  # each rank owns the ids hashing to it, C / W rows
        raise PlanError(f"--dynamic-capacity: {args.dynamic_capacity:,} rows must split evenly over the "
                        f"{nodes * devices} ranks of --topology (dynamic tables are row_wise over every rank)")
    t1 = time.perf_counter()
    plan = plan_sharding(tables, topology, args.batch_size, config=config, constraints=_constraints(args.constraint),
                         force=args.force_sharding, min_column_dim=args.min_column_dim, time_limit_s=args.time_limit,
                         tiers=tiers, even_row_wise=dynamic)
    t2 = time.perf_counter()
    print(render_plan(plan, tables, CostModel(topology, args.batch_size, config), top=args.top))
    print(f"planned in {format_seconds(t2 - t1)} (building the tables: {format_seconds(t1 - t0)})")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, plan.to_json())
        print(f"wrote {out}")
    return plan
