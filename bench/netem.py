"""Multi-node training over an emulated network: one Linux network namespace per rank, joined by a bridge,
each rank's link shaped with ``tc`` (token bucket at ``--rate``; plus ``--delay`` where the kernel has netem).

For every codec setting a real multi-node ``torchrun`` runs (one node per namespace, gloo over the
namespace's interface) for a fixed number of steps on the same synthetic Terabyte-shaped data; the report
gives samples/s, the per-step time breakdown (all-to-alls, all-reduce, rest) and the final AUC, per codec
and seed, as JSON and ``netem.png``. Everything created (namespaces, links, bridge) is removed at the end,
also on Ctrl-C or failure. Only the addresses of the namespaces made here are used. Needs root.

    python bench/netem.py [--world 2] [--rate 200mbit | --calibrate] [--steps 40] [--seeds 0,1,2]

``--calibrate`` first runs fp32 at several rates and picks the one where the all-to-alls take closest to
60% of the step (the share in Feng et al.'s breakdown).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUBNET = "10.213.77"  # addresses exist only inside the namespaces made here
CODECS: dict[str, list[str]] = {
    "fp32": ['dist.forward_codec="fp32"', 'dist.backward_codec="fp32"'],
    "fp16-fwd": ['dist.forward_codec="fp16"', 'dist.backward_codec="fp32"'],
    "eb-fwd": ['dist.forward_codec="eb"', 'dist.backward_codec="fp32"'],
    "fp16": ['dist.forward_codec="fp16"', 'dist.backward_codec="fp16"'],
    "eb": ['dist.forward_codec="eb"', 'dist.backward_codec="eb"', "compression.error_feedback=true"],
    # gradients summed per distinct id before the backward all-to-all (one-hot features)
    "fp32-agg": ['dist.forward_codec="fp32"', 'dist.backward_codec="fp32"', "dist.aggregate_gradients=true"],
    "eb-agg": ['dist.forward_codec="eb"', 'dist.backward_codec="eb"', "dist.aggregate_gradients=true"],
}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class NetemCluster:
    """``world`` namespaces ``<prefix><k>`` with interface eth0 at SUBNET.(k+1), bridged in ``<prefix>br``.

    Use as a context manager; ``close()`` deletes the namespaces (which deletes their links) and is safe to
    call twice. SIGINT and SIGTERM inside the block raise KeyboardInterrupt so the cleanup runs."""

    def __init__(self, world: int, rate: str = "1gbit", delay: str = "", prefix: str | None = None) -> None:
        self.world, self.rate, self.delay = world, rate, delay
        self.prefix = prefix or f"rsn{os.getpid() % 100000}x"
        self.made: list[str] = []
        self.delay_applied = False
        self._old_handlers: dict[int, Any] = {}

    @staticmethod
    def available() -> str | None:
        """None when namespaces can be made here, else the reason why not."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if not (shutil.which("ip") and shutil.which("tc")):
            return "the ip and tc commands (iproute2) are missing"
        probe = f"rsnprobe{os.getpid() % 100000}"
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"cannot create a network namespace: {r.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def ns(self, k: int) -> str:
        return f"{self.prefix}{k}"

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def __enter__(self) -> NetemCluster:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._interrupt)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def _create(self) -> None:
        bridge = f"{self.prefix}br"
        _ip("netns", "add", bridge)
        self.made.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for k in range(self.world):
            ns = self.ns(k)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", f"{self.prefix}v{k}", "netns", ns, "type", "veth", "peer", "name", f"p{k}",
                "netns", bridge)
            _ip("-n", ns, "link", "set", f"{self.prefix}v{k}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", bridge, "link", "set", f"p{k}", "master", "br0")
            _ip("-n", bridge, "link", "set", f"p{k}", "up")
            self._shape(ns)

    def _shape(self, ns: str) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0"]
        parent = ["root"]
        if self.delay:  # netem is a kernel module that not every kernel has
            r = subprocess.run([*tc, "root", "handle", "1:", "netem", "delay", self.delay], capture_output=True)
            if r.returncode == 0:
                self.delay_applied, parent = True, ["parent", "1:"]
        subprocess.run([*tc, *parent, "handle", "2:", "tbf", "rate", self.rate, "burst", "256kb", "latency",
                        "100ms"], check=True, capture_output=True)

    def close(self) -> None:
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        self.made.clear()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def run(self, module_args: list[str], timeout: float, port: int = 29500) -> list[subprocess.CompletedProcess]:
        """``torchrun --nnodes world`` with one node per namespace running ``python -m <module_args>``."""
        procs = []
        for k in range(self.world):
            cmd = ["ip", "netns", "exec", self.ns(k), "env", "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1",
                   sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.world), "--nproc_per_node",
                   "1", "--node_rank", str(k), "--master_addr", self.address(0), "--master_port", str(port),
                   "-m", *module_args]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          cwd=ROOT))
        out = []
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 1))
                out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return out


def train_args(data: Path, out: Path, steps: int, seed: int, extra: list[str]) -> list[str]:
    """Terabyte-shaped DLRM (dim 64, 13-512-256-64 / 512-512-256-1), one thread per rank."""
    sets = [f'data.train="{data}"', "data.eval_fraction=0.1", "model.embedding_dim=64",
            "model.bottom_mlp=[512, 256, 64]", "model.top_mlp=[512, 512, 256, 1]", "train.batch_size=1024",
            f"train.max_steps={steps}", "train.log_every=5", "train.threads=1", "train.progress=false",
            f"train.seed={seed}", "train.eval_batch_size=8192", *extra]
    args = ["recstack", "train", "--output-dir", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def breakdown(run: Path) -> dict[str, float]:
    """Mean per-step seconds of each phase over the logged training windows (the first one skipped)."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"][1:] or [x for x in lines if x["kind"] == "train"]
    keys = sorted({k for x in train for k in x if k.startswith(("time_", "eb_")) and "bound" not in k})
    out = {k: statistics.mean(x.get(k) or 0.0 for x in train) for k in keys}
    out["samples_per_sec"] = statistics.mean(x["samples_per_sec"] for x in train)
    out["bytes_fwd_a2a"] = statistics.mean(x.get("bytes_fwd_a2a", 0.0) for x in train)
    out["bytes_bwd_a2a"] = statistics.mean(x.get("bytes_bwd_a2a", 0.0) for x in train)
    a2a = out.get("time_fwd_a2a", 0.0) + out.get("time_bwd_a2a", 0.0)
    out["a2a_share"] = a2a / out["time_step"] if out.get("time_step") else 0.0
    return out


def run_case(cluster: NetemCluster, data: Path, work: Path, codec: str, seed: int, steps: int,
             extra: list[str] | None = None) -> dict[str, Any]:
    out = work / f"{codec}_s{seed}_{cluster.rate}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    res = cluster.run(train_args(data, out, steps, seed, [*CODECS[codec], *(extra or [])]), timeout=1800)
    bad = [r for r in res if r.returncode != 0]
    if bad:
        raise RuntimeError(f"{codec} seed {seed}: a rank failed:\n{bad[0].stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"codec": codec, "seed": seed, "rate": cluster.rate, "auc": summary["auc"], "wall_s":
            time.perf_counter() - t0, **breakdown(out)}


def make_data(work: Path, rows: int) -> Path:
    from recstack.data.prepare.criteo import TERABYTE_CARDINALITIES
    from recstack.data.synth.generate import SynthConfig, generate

    data = work / "data"
    if not (data / "meta.json").is_file():
        generate(SynthConfig(rows=rows, seed=0, table_sizes=tuple(TERABYTE_CARDINALITIES), max_table_size=20000),
                 data, progress=False)
    return data


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    codecs = list(dict.fromkeys(c["codec"] for c in cases if c["rate"] == results["rate"]))
    mean = {k: {f: statistics.mean(c[f] for c in cases if c["codec"] == k and c["rate"] == results["rate"])
                for f in ("samples_per_sec", "time_step", "time_fwd_a2a", "time_bwd_a2a", "time_allreduce_dense")}
            for k in codecs}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.bar(codecs, [mean[k]["samples_per_sec"] for k in codecs], color="tab:blue")
    a1.set_ylabel("samples/s")
    a1.set_title(f"{results['world']} ranks, {results['rate']} links")
    bottom = [0.0] * len(codecs)
    for key, label in (("time_fwd_a2a", "forward all-to-all"), ("time_bwd_a2a", "backward all-to-all")):
        vals = [mean[k][key] * 1e3 for k in codecs]
        a2.bar(codecs, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    rest = [mean[k]["time_step"] * 1e3 - b for k, b in zip(codecs, bottom, strict=True)]
    a2.bar(codecs, rest, bottom=bottom, label="everything else", color="tab:gray")
    a2.set_ylabel("ms per step")
    a2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--delay", default="0.1ms")
    p.add_argument("--calibrate", action="store_true", help="pick the rate where fp32 spends ~60%% in all-to-alls")
    p.add_argument("--calibration", help="reuse the calibration of an earlier result JSON")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, e.g. compression.schedule_stage=10")
    p.add_argument("--work", default="/tmp/recstack-netem")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "netem.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "netem.png"))
    args = p.parse_args(argv)
    reason = NetemCluster.available()
    if reason:
        raise SystemExit(f"netem: {reason}")
    work = Path(args.work)
    data = make_data(work, args.rows)
    results: dict[str, Any] = {"world": args.world, "steps": args.steps, "rate": args.rate, "cases": [],
                               "calibration": [], "overrides": args.overrides}
    rate = args.rate
    if args.calibration:
        earlier = json.loads(Path(args.calibration).read_text())
        results["calibration"], rate = earlier["calibration"], earlier["rate"]
        results["rate"] = rate
    elif args.calibrate:
        for r in ("50mbit", "100mbit", "200mbit", "400mbit"):
            with NetemCluster(args.world, r, args.delay) as c:
                case = run_case(c, data, work, "fp32", 0, min(args.steps, 15))
            results["calibration"].append(case)
            print(f"calibrate {r}: all-to-all share {case['a2a_share']:.2f}", file=sys.stderr)
        rate = min(results["calibration"], key=lambda c: abs(c["a2a_share"] - 0.6))["rate"]
        results["rate"] = rate
    with NetemCluster(args.world, rate, args.delay) as c:
        results["delay_applied"] = c.delay_applied
        for seed in (int(s) for s in args.seeds.split(",")):
            for codec in args.codecs.split(","):
                case = run_case(c, data, work, codec, seed, args.steps, args.overrides)
                results["cases"].append(case)
                print(f"{codec} seed {seed}: {case['samples_per_sec']:.0f} samples/s, AUC {case['auc']:.4f}, "
                      f"all-to-all share {case['a2a_share']:.2f}", file=sys.stderr)
    by = {k: [c for c in results["cases"] if c["codec"] == k] for k in CODECS}
    base = statistics.mean(c["samples_per_sec"] for c in by["fp32"]) if by["fp32"] else None
    results["speedup_vs_fp32"] = {k: statistics.mean(c["samples_per_sec"] for c in v) / base
                                  for k, v in by.items() if v and base}
    results["auc_delta_vs_fp32"] = {
        k: max(abs(c["auc"] - f["auc"]) for c in v for f in by["fp32"] if f["seed"] == c["seed"])
        for k, v in by.items() if v and by["fp32"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    plot(results, Path(args.plot))
    print(json.dumps({k: results[k] for k in ("rate", "speedup_vs_fp32", "auc_delta_vs_fp32")}, indent=1))
    return results


if __name__ == "__main__":
    main()
