"""Serving benchmark on the Criteo Kaggle reference DLRM (tables capped at 1M rows): model-only samples/s of the
exported ``ServingModel`` (fp32 / int8 / int4 tables) against the eager training model in fp32 and TorchRec's
quantized inference collection, and ``recstack serve`` over HTTP at fixed offered loads.

Model: dim 16, bottom MLP 13-512-256-64-16, top MLP 512-256-1, dot interaction, 26 tables at the Kaggle
cardinalities capped at 1M rows (about 5.6M rows), one id per feature; a step-0 checkpoint of a real
``Trainer`` (weights do not change speed), exported by ``export_checkpoint`` at each width. Ids are synthetic
(Zipf-like, as ``bench/train_throughput.py``), so requests carry encoded ids (``"encoded": true``).

Arms, all in one run:

- ``model``: a worker process times, interleaved round by round (the order rotated), one call on a ready
  batch of 1, 64, 512, 2048 rows for ``eager`` (``load_model``'s DLRM) and the ``fp32`` / ``int8`` / ``int4``
  ``ServingModel.score``; samples/s = batch / median call time.
- ``torchrec``: in the separate bench environment (``--torchrec-python``, TorchRec + FBGEMM), the same model's
  dense layers on TorchRec's int8 ``QuantEmbeddingBagCollection`` (``quantize_inference_model``), timed
  interleaved with recstack's int8 in that same process; skipped with the reason where TorchRec does not import.
- ``http``: ``recstack serve`` (int8 tables) with 1 and 2 worker processes; an open-loop ``httpx`` async
  client offers fixed request rates (requests of 1 candidate, and one user with 100 candidates) for a few
  seconds each; latency is from each request's scheduled send time to its answer (so a slow server is not
  hidden by a client that waits); the highest offered rate with p99 <= 10 ms and no error is reported.

JSON on stdout (and ``--out``), markdown on stderr, issue targets stated met or missed.

    python bench/serving.py [--quick] [--out results.json] [--torchrec-python PATH|none]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.serving_http import markdown as http_markdown  # noqa: E402
from bench.serving_http import run as http_run  # noqa: E402
from bench.serving_http import targets as http_targets  # noqa: E402
from bench.train_throughput import NUM_DENSE, kaggle_config, machine_info, run_worker, zipf_ids  # noqa: E402
from recstack.data.batch import Batch, SparseFeatures  # noqa: E402
from recstack.data.format import SparseFeatureSpec, capped_table_sizes  # noqa: E402
from recstack.data.prepare.criteo import KAGGLE_CARDINALITIES  # noqa: E402
from recstack.data.prepared_writer import PreparedWriter  # noqa: E402

WIDTHS = ("fp32", "int8", "int4")
BATCHES = (1, 64, 512, 2048)
TORCHREC_PYTHON = "/work/bench-venv/bin/python"
P99_BUDGET_S = 0.010


def build_models(tmp: Path, quick: bool) -> tuple[Path, dict[str, Path], list[int]]:
    """A step-0 checkpoint of the reference model and its artifact at each width -> (run, {width: dir}, sizes)."""
    from recstack.serving.export import export_checkpoint
    from recstack.training.trainer import Trainer

    cap = 2000 if quick else 1_000_000
    sizes = capped_table_sizes(KAGGLE_CARDINALITIES, cap)
    cfg = kaggle_config()
    cfg.model.max_table_size = cap
    cfg.train.batch_size = 64
    rng = np.random.default_rng(0)
    specs = [SparseFeatureSpec(f"C{i + 1}", n) for i, n in enumerate(sizes)]
    data = tmp / "data"
    with PreparedWriter(data, [f"I{i + 1}" for i in range(NUM_DENSE)], specs) as w:
        n = cfg.train.batch_size
        w.write((rng.random(n) < 0.25).astype(np.float32), rng.random((n, NUM_DENSE), dtype=np.float32),
                np.stack([rng.integers(0, s, n) for s in sizes], axis=1))
    cfg.data.train, cfg.data.eval_fraction = str(data), 0.0
    trainer = Trainer(cfg, tmp / "run")
    trainer.save()
    models = {w: export_checkpoint(tmp / "run", tmp / f"model_{w}", tables=w)[0] for w in WIDTHS}
    return tmp / "run", models, sizes


def inputs(sizes: list[int], batch: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n distinct (dense [B, 13], ids [B, 26]) inputs, built before timing."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(batch, NUM_DENSE, generator=gen).mul_(8.0).log1p_(), zipf_ids(sizes, batch, gen))
            for _ in range(n)]


def time_arms(arms: dict[str, Any], batch: int, rounds: int, window_s: float) -> dict[str, float]:
    """arms: name -> (call, args list). Interleaved windows, order rotated each round -> samples/s per arm."""
    names = list(arms)
    times: dict[str, list[float]] = {k: [] for k in names}
    for name in names:  # warm-up
        call, args = arms[name]
        for a in args[:3]:
            call(a)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call, args = arms[name]
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < window_s or calls < 3:
                call(args[calls % len(args)])
                calls += 1
            times[name].append((time.perf_counter() - start) / calls)
    return {k: batch / statistics.median(v) for k, v in times.items()}


def model_worker(run: Path, models: dict[str, Path], sizes: list[int], rounds: int, window_s: float) -> dict:
    """The model-only arms of recstack, in this process."""
    from recstack.serving.model import EncodedBatch, ServingModel
    from recstack.training.inference import load_model

    _, eager = load_model(run, "cpu")
    served = {w: ServingModel.load(models[w]) for w in WIDTHS}
    out = {}
    for batch in BATCHES:
        data = inputs(sizes, batch, 8 if batch < 2048 else 4, seed=batch)
        sparse = [SparseFeatures.from_dense_ids(ids) for _, ids in data]
        eager_args = [Batch(d, s, torch.zeros(batch)) for (d, _), s in zip(data, sparse, strict=True)]
        enc = [EncodedBatch(d, s) for (d, _), s in zip(data, sparse, strict=True)]

        def run_eager(b: Batch) -> None:
            with torch.inference_mode():
                eager(b)

        arms = {"eager_fp32": (run_eager, eager_args)}
        arms.update({w: (served[w].score, enc) for w in WIDTHS})
        out[str(batch)] = time_arms(arms, batch, rounds, window_s)
        print(f"model-only batch {batch}: {out[str(batch)]}", file=sys.stderr, flush=True)
    memory = {w: served[w].manifest["table_bytes"] for w in WIDTHS}
    return {"samples_per_s": out, "table_bytes": memory}


def torchrec_worker(run: Path, int8_model: Path, sizes: list[int], rounds: int, window_s: float) -> dict:
    """TorchRec's int8 inference collection under the same dense layers, against recstack's int8 (this process)."""
    import torchrec
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recstack.serving.model import EncodedBatch, ServingModel
    from recstack.training.inference import load_model

    _, eager = load_model(run, "cpu")
    keys = [f"C{i + 1}" for i in range(len(sizes))]
    emb = eager.embeddings
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=16, num_embeddings=n, feature_names=[k])
              for k, n in zip(keys, sizes, strict=True)]

    class TorchRecDLRM(torch.nn.Module):
        """recstack's trained dense layers (the very modules) over a TorchRec embedding-bag collection."""

        def __init__(self) -> None:
            super().__init__()
            self.ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
            with torch.no_grad():
                for k, w in zip(keys, self.ebc.embedding_bags.values(), strict=True):
                    w.weight.copy_(emb.table_weight(k))
            self.bottom, self.interaction, self.top = eager.bottom, eager.interaction, eager.top

        def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
            pooled = self.ebc(kjt).values().view(dense.shape[0], len(keys), 16)  # [B, F, D]
            return self.top(self.interaction(self.bottom(dense), pooled)).squeeze(1)

    tr = quantize_inference_model(TorchRecDLRM().eval(), fp_weight_dtype=torch.int8,
                                  quantization_dtype=torch.int8)
    ours = ServingModel.load(int8_model)

    def kjt(ids: torch.Tensor) -> KeyedJaggedTensor:  # ids [B, F] -> feature-major jagged, one id a bag
        return KeyedJaggedTensor(keys=keys, values=ids.t().reshape(-1).contiguous(),
                                 lengths=torch.ones(ids.numel(), dtype=torch.int32))

    def run_tr(a: tuple) -> None:
        with torch.inference_mode():
            tr(*a)

    out = {}
    for batch in BATCHES:
        data = inputs(sizes, batch, 8 if batch < 2048 else 4, seed=batch)
        trargs = [(d, kjt(ids)) for d, ids in data]
        enc = [EncodedBatch(d, SparseFeatures.from_dense_ids(ids)) for d, ids in data]
        out[str(batch)] = time_arms({"torchrec_int8": (run_tr, trargs), "int8": (ours.score, enc)}, batch, rounds,
                                    window_s)
        print(f"torchrec batch {batch}: {out[str(batch)]}", file=sys.stderr, flush=True)
    d, ids = inputs(sizes, 64, 1, seed=7)[0]  # both compute the same model, each with its own int8 rounding
    with torch.inference_mode():
        diff = (tr(d, kjt(ids)) - ours.score(EncodedBatch(d, SparseFeatures.from_dense_ids(ids)))).abs().max()
    return {"samples_per_s": out, "torchrec": getattr(torchrec, "__version__", "unknown"),
            "max_abs_logit_diff_vs_recstack_int8": float(diff)}


def run_subprocess(cmd: list[str], threads: int) -> tuple[dict | None, str]:
    """Run a worker with ``threads`` torch threads -> (its JSON with the other load it ran under, or None;
    why not)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    code, out, err, others = run_worker(cmd, env, threads)
    if code != 0:
        sys.stderr.write(err[-2000:])
        return None, f"exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}"
    res = json.loads(out.strip().splitlines()[-1])
    res["other_runnable"] = others
    return res, ""


# ---------------------------------------------------------------------------------------------------- HTTP
def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)  # ppid, utime + stime
    todo, total = [pid], 0.0
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo.extend(c for c, (ppid, _) in stats.items() if ppid == p)
    return total


async def offer(url: str, bodies: list[bytes], rate: float, duration_s: float, server_pid: int) -> dict[str, Any]:
    """Open-loop load: request i is sent at t0 + i / rate whatever the answers; latency from that time. Also the
    CPU time the server processes and this client spent per request: what a request costs whatever else runs."""
    import httpx

    n = max(1, int(rate * duration_s))
    lat: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    cpu0, client0 = tree_cpu_s(server_pid), time.process_time()
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.05

        async def one(i: int) -> None:
            nonlocal errors
            when = t0 + i / rate
            await asyncio.sleep(max(0.0, when - loop.time()))
            try:
                r = await client.post("/v1/score", content=bodies[i % len(bodies)],
                                      headers={"content-type": "application/json"})
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                lat.append(loop.time() - when)
            else:
                errors += 1

        await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = loop.time() - t0
    server_cpu, client_cpu = tree_cpu_s(server_pid) - cpu0, time.process_time() - client0
    q = np.percentile(lat, [50, 99]) * 1e3 if lat else [float("nan")] * 2
    return {"offered_rps": rate, "requests": n, "errors": errors, "achieved_rps": round(len(lat) / elapsed, 1),
            "p50_ms": round(float(q[0]), 3), "p99_ms": round(float(q[1]), 3),
            "server_cpu_ms_per_request": round(server_cpu / n * 1e3, 3),
            "client_cpu_ms_per_request": round(client_cpu / n * 1e3, 3),
            "load_avg_1m": round(os.getloadavg()[0], 2)}  # the machine's load: how far to trust the row


# ---------------------------------------------------------------------------------------------------- report
def check_targets(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's targets -> {target: {"met": bool | None, "value": ..., "note": ...}} (None: not measured)."""
    out: dict[str, dict[str, Any]] = {}
    if "model" in res:
        sps = res["model"]["samples_per_s"]
        big = sps["2048"]
        ratio = big["int8"] / big["eager_fp32"]
        out["int8 model-only at batch 2048 >= 1.5x eager fp32"] = {"met": ratio >= 1.5, "value": round(ratio, 2)}
        tr = res.get("torchrec")
        if tr and "samples_per_s" in tr:
            t = tr["samples_per_s"]["2048"]
            r = t["int8"] / t["torchrec_int8"]
            out["int8 model-only at batch 2048 >= TorchRec's quantized collection"] = {"met": r >= 1.0,
                                                                                       "value": round(r, 2)}
        else:
            out["int8 model-only at batch 2048 >= TorchRec's quantized collection"] = {
                "met": None, "note": f"not run: {(tr or {}).get('skipped', 'no result')}"}
        mem = res["model"]["table_bytes"]
        for w, bound in (("int8", 0.3), ("int4", 0.17)):
            out[f"table memory {w} <= {bound}x fp32"] = {"met": mem[w]["ratio"] <= bound,
                                                         "value": round(mem[w]["ratio"], 4)}
        out["AUC change int8 <= 0.0005"] = {"met": None, "note": "measured on real held-out data in the export "
                                            "half (docs/serving.md); this benchmark's ids are synthetic"}
    if "http" in res:
        out.update(http_targets(res["http"]))
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = []
    if "model" in res:
        lines += ["| batch | eager fp32 | fp32 | int8 | int4 | TorchRec int8 (its run: recstack int8) | int8 / eager |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        tr = (res.get("torchrec") or {}).get("samples_per_s")
        for b, v in res["model"]["samples_per_s"].items():
            t = tr.get(b) if tr else None
            trc = f"{t['torchrec_int8']:,.0f} ({t['int8']:,.0f})" if t else "skipped"
            lines.append(f"| {b} | {v['eager_fp32']:,.0f} | {v['fp32']:,.0f} | {v['int8']:,.0f} | "
                         f"{v['int4']:,.0f} | {trc} | {v['int8'] / v['eager_fp32']:.2f}x |")
        lines += ["", "model-only samples/s (one call on a ready batch; median of interleaved rounds)", ""]
    if "http" in res:
        lines += [http_markdown(res["http"]), ""]
    lines += ["| target | result |", "|---|---|"]
    for k, v in res["targets"].items():
        met = {True: "met", False: "MISSED", None: "not measured"}[v["met"]]
        detail = ", ".join(str(x) for x in (v.get("value"), v.get("note")) if x is not None)
        lines.append(f"| {k} | {met}{f' ({detail})' if detail else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny tables, short windows, few rates (a smoke test)")
    p.add_argument("--out", type=Path, help="also write the JSON results to this file")
    p.add_argument("--torchrec-python", default=TORCHREC_PYTHON,
                   help=f"python of the environment with TorchRec (default {TORCHREC_PYTHON}; none: skip)")
    p.add_argument("--no-http", action="store_true", help="model-only arms only")
    p.add_argument("--http-only", action="store_true", help="the HTTP arm (wrk) only")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per wrk cell (default 4)")
    p.add_argument("--max-ind-range", type=int, default=200_000,
                   help="rows of each of the 26 hashed tables of the HTTP arm's model (default 200000)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the model-only arms and of each "
                   "server worker (default 1: steadiest on a shared machine, and recstack serve's default)")
    p.add_argument("--worker", choices=("model", "torchrec"), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    rounds, window = (2, 0.1) if a.quick else (7, 0.6)
    if a.worker:  # one arm group in its own process
        torch.set_num_threads(a.threads)
        spec = json.loads(a.spec)
        run, models, sizes = Path(spec["run"]), {k: Path(v) for k, v in spec["models"].items()}, spec["sizes"]
        if a.worker == "model":
            res = model_worker(run, models, sizes, rounds, window)
        else:
            res = torchrec_worker(run, models["int8"], sizes, rounds, window)
        print(json.dumps(res))
        return 0

    t0 = time.perf_counter()
    info = machine_info()
    res: dict[str, Any] = {"benchmark": "serving"}
    if not a.http_only:
        with tempfile.TemporaryDirectory(prefix="recstack-bench-serving-") as tmp:
            run, models, sizes = build_models(Path(tmp), a.quick)
            spec = json.dumps({"run": str(run), "models": {k: str(v) for k, v in models.items()}, "sizes": sizes})
            worker = [str(Path(__file__).resolve()), "--spec", spec, "--threads", str(a.threads),
                      *(["--quick"] if a.quick else [])]
            model_res, why = run_subprocess([sys.executable, *worker, "--worker", "model"], a.threads)
            if model_res is None:
                raise SystemExit(f"model-only arms failed: {why}")
            res["description"] = ("DLRM Criteo Kaggle: dim 16, bottom 13-512-256-64-16, top 512-256-1, dot, 26 "
                                  "tables <= " + ("2000 rows (--quick)" if a.quick else "1M rows"))
            res["rows_total"], res["model"] = sum(sizes), model_res
            tp = a.torchrec_python
            if tp == "none" or not Path(tp).is_file():
                res["torchrec"] = {"skipped": "no TorchRec environment" if tp != "none" else "--torchrec-python none"}
            else:
                tr, why = run_subprocess([tp, *worker, "--worker", "torchrec"], a.threads)
                res["torchrec"] = tr if tr is not None else {"skipped": f"TorchRec arm failed: {why}"}
    if not a.no_http:
        res["http"] = http_run(2.0 if a.quick else a.duration, 2000 if a.quick else a.max_ind_range, a.quick)
    res["threads"] = a.threads
    res["targets"] = check_targets(res)
    res["machine"] = {**info, "load_avg_end": [round(x, 2) for x in os.getloadavg()]}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(markdown(res), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
