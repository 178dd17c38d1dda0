"""``recstack exfm run``: one FM teaching several VMs through the DAS, over arms x staleness x seeds.

Per seed the runner prepares the stream (a synthetic log, or MovieLens once for all seeds), then runs:

* the FM stream (one task), and, from the moment it starts, one DAS process (``python -m
  recstack.exfm.das``) with one feed, i.e. one store, per staleness;
* per vertical a warm-up task (the VM alone on windows [0, vm_start)), then the VM-alone continuation and one
  task per (arm, staleness), each starting from that warm-up and reading its FM labels from the store of its
  staleness as the DAS commits them.

Every task's directory (the FM's with its snapshots) and every DAS store is named with a hash of the config
parts its result depends on (``fm_key``, ``store_key``, ``warmup_key``, ``arm_key``). A task whose
``result.json`` exists under that name is reused and an interrupted one resumes from its last window
checkpoint, so rerunning the command after a crash finishes the experiment; a changed config runs what it
changes in new directories and never reports a result made under another. The report (``results.json``,
``report.md``, ``ne_gain.png``, ``ne_by_window.png``) is written to the output directory at the end.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from recstack.data.integrity import check_values
from recstack.data.prepare.schema import load_schema
from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.stream.partition import SchemaPartitions
from recstack.data.stream.source import DirectoryStream
from recstack.errors import ConfigError, ServiceFailure, StreamError
from recstack.exfm.config import ExfmConfig, StreamSourceSpec, exfm_config_from_dict, movielens_config, synth_config
from recstack.exfm.das import DasJob
from recstack.exfm.lifetime import exit_with_parent
from recstack.exfm.stream_windows import MANIFEST, open_windows
from recstack.exfm.vm_publish import PublisherFactory
from recstack.exfm.vm_stream import VMJob
from recstack.exfm.windows import VerticalIndex, make_windows
from recstack.io import atomic_write_text


def _tag(values: Any) -> str:
    """A short stable name for a config (JSON values), so a changed config never reuses what another made."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:10]


def prepare_stream(cfg: ExfmConfig, out: Path, seed: int) -> Path:
    """The prepared data set of ``seed`` (generated or converted on first use, then reused; ``data.prepared`` as
    it is), or a directory stream's directory."""
    if cfg.data.source == "prepared":
        return Path(cfg.data.prepared)
    if cfg.data.source == "stream":
        return Path(cfg.data.stream.dir)
    if cfg.data.source == "movielens":
        from recstack.exfm.movielens import prepare_movielens

        ml = movielens_config(cfg.data.movielens)
        path = out / "data" / f"movielens_{_tag(asdict(ml))}"
        if not (path / "meta.json").is_file():
            prepare_movielens(ml, path, overwrite=True)
        return path
    from recstack.data.synth.generate import generate

    synth = synth_config(cfg.data.synth, seed if cfg.experiment.vary_data_seed else None)
    path = out / "data" / f"synth_seed{synth.seed}_{_tag(synth.to_dict())}"
    if not (path / "meta.json").is_file():
        generate(synth, path, progress=False, overwrite=True)
    return path


@dataclass
class Task:
    key: str
    kind: str  # fm | vm
    payload: dict[str, Any]
    result: Path
    deps: list[str] = field(default_factory=list)
    seed: int = 0


# What a task's result.json must hold to be reused: an FM's result is an object, a VM's has these
# keys.
_RESULT_KEYS = {"fm": (), "vm": ("job", "records", "summary")}


def read_result(task: Task) -> dict[str, Any]:
    """A finished task's ``result.json`` -> its result; a ValueError naming the file when it is
    damaged (cut short, not JSON, not the result of that kind of task)."""
    try:
        result = json.loads(task.result.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{task.result}: damaged result ({type(e).__name__}: {e})") from None
    keys = result if isinstance(result, dict) else {}
    missing = [k for k in _RESULT_KEYS[task.kind] if k not in keys]
    if not isinstance(result, dict) or missing:
        want = ", ".join(missing) or "keys"
        raise ValueError(f"{task.result}: damaged result (not an object with {want})")
    return result


# The stream fields a VM's warm-up depends on (``publish_every`` only matters once FM labels flow).
_WARMUP_STREAM = ("window", "window_rows", "max_windows", "vm_start")


def data_key(cfg: ExfmConfig, data: Path) -> str:
    """The data a task reads, in the keys below: a generated or converted set's directory name (a hash of the
    data config); a given prepared set's or stream's directory (and the stream's schema and idle wait)."""
    if cfg.data.source == "prepared":
        return f"prepared_{_tag(str(data.resolve()))}"
    if cfg.data.source == "stream":
        st = cfg.data.stream
        schema = Path(st.schema).read_text(encoding="utf-8", errors="replace")
        return f"stream_{_tag({'dir': str(data.resolve()), 'schema': schema, 'idle_s': st.idle_s})}"
    return data.name


def fm_key(cfg: ExfmConfig, data: str, seed: int) -> str:
    """The FM stream of ``seed`` (checkpoints, snapshots, result): the data (``data_key``), ``[fm]``,
    ``[stream]`` (windows, publishing, evaluation from ``vm_start``) and the seed."""
    return _tag({"data": data, "fm": asdict(cfg.fm), "stream": asdict(cfg.stream), "seed": seed})


def store_key(cfg: ExfmConfig, fm: str, staleness: int, verticals: list[int]) -> str:
    """A DAS store: the FM whose snapshots label it (``fm_key``, which holds the data and the stream), the
    staleness, the verticals it labels and its part size (a restarted DAS checks its recorded parts)."""
    return _tag({"fm": fm, "staleness": staleness, "verticals": verticals,
                 "part_rows": cfg.experiment.das_part_rows})


def warmup_key(cfg: ExfmConfig, data: str, seed: int, vertical: int) -> str:
    """A VM's warm-up (alone on windows [0, vm_start)): the data (``data_key``), ``[vm]``, the windows, seed and
    vertical."""
    stream = asdict(cfg.stream)
    return _tag({"data": data, "vm": asdict(cfg.vm), "stream": {k: stream[k] for k in _WARMUP_STREAM},
                 "seed": seed, "vertical": vertical})


def arm_key(cfg: ExfmConfig, job: VMJob, warm: str, store: str) -> str:
    """A VM arm: its warm-up (``warmup_key``), ``[stream]``, the arm and its staleness, and for arms with FM
    labels the DAS store (``store_key``), ``[distill]`` and what happens to unlabelled examples."""
    labels = job.staleness >= 0
    return _tag({"warmup": warm, "stream": asdict(cfg.stream), "arm": job.arm, "staleness": job.staleness,
                 "store": store if labels else None, "distill": asdict(cfg.distill) if labels else None,
                 "on_missing": job.on_missing if labels else None,
                 "distill_head_init": job.distill_head_init if labels else None})


def _dead_worker(tasks: list[Task], finished: int) -> str:
    """The one line for a task worker that died (the executor says only that one did, not which or
    how): the tasks that were running, and what a rerun does."""
    return (f"an ExFM task worker ended abruptly (killed by a signal or the out-of-memory killer) "
            f"while running {', '.join(t.key for t in tasks)}; the {finished} finished tasks are "
            "kept, rerun the same command to continue")


def _init_worker(threads: int, runner_pid: int) -> None:
    torch.set_num_threads(threads)
    exit_with_parent(runner_pid)  # a killed runner leaves no worker training on


def _run_task(kind: str, payload: dict[str, Any], publisher: PublisherFactory | None = None) -> dict[str, Any]:
    """Runs in a worker process; ``publisher`` builds the hook of a VM job that publishes (``publish_root``)."""
    if kind == "fm":
        from recstack.exfm.fm import run_fm_windows

        cfg = exfm_config_from_dict(payload["config"])
        out = Path(payload["out_dir"])
        # the FM leads a directory stream: it decides which partitions are windows (the manifest others follow)
        source = open_windows(payload["data"], cfg.stream, cfg.data.stream if cfg.data.source == "stream" else
                              StreamSourceSpec(), str(out / MANIFEST), 0.0, leader=True)
        result = run_fm_windows(source, cfg.fm, payload["seed"], out, cfg.stream.publish_every,
                                eval_from=cfg.stream.vm_start)
        if len(result["records"]) <= cfg.stream.vm_start:
            raise StreamError(f"stream.vm_start: the stream {payload['data']} ended after {len(result['records'])} "
                              f"windows (data.stream.idle_s = {cfg.data.stream.idle_s:g} s without a new partition), "
                              f"none from vm_start={cfg.stream.vm_start} on for the VMs")
        atomic_write_text(out / "result.json", json.dumps(result, indent=1))
        return result
    from recstack.exfm.vm_stream import run_vm_stream

    job = VMJob.from_dict(payload)
    hooks = [publisher(job.publish_root, job.publish_every_s, job.publish_tables)] if job.publish_root and \
        publisher is not None else []
    return run_vm_stream(job, hooks=hooks)


class ExperimentRunner:
    """``publisher``: builds the hook that publishes ``experiment.publish_vm``'s VM (``recstack exfm run`` passes
    the serving ``Publisher``; a picklable callable, as it runs in the task's worker process)."""

    def __init__(self, cfg: ExfmConfig, out_dir: str | Path, log=print,
                 publisher: PublisherFactory | None = None) -> None:
        if cfg.experiment.publish_vm.enabled and publisher is None:
            raise ConfigError("experiment.publish_vm: this runner was given no publisher (recstack exfm run gives it "
                              "one; from Python: ExperimentRunner(..., "
                              "publisher=recstack.serving.publish.make_publisher))")
        self.cfg = cfg
        self.publisher = publisher
        self.out = Path(out_dir)
        self.log = log
        self.das: dict[int, subprocess.Popen] = {}
        self.data: dict[int, Path] = {}  # seed -> prepared stream
        self.verticals: dict[int, list[int]] = {}  # seed -> verticals with a VM
        self.fm_dirs: dict[int, Path] = {}  # seed -> the FM's directory (checkpoints, snapshots, result)
        self.stores: dict[int, dict[int, Path]] = {}  # seed -> staleness -> DAS store

    def plan(self) -> list[Task]:
        """Every task of the experiment, FM tasks first (the DAS waits on them), then warm-ups, then arms.
        Directories are named by the keys above, so only a task made under the same config is reused."""
        cfg, e = self.cfg, self.cfg.experiment
        fm_tasks, warm_tasks, arm_tasks = [], [], []
        for seed in e.seeds:
            data = prepare_stream(cfg, self.out, seed)
            self.data[seed] = data
            verts = self._verticals(data, seed)
            if e.publish_vm.enabled and seed == e.publish_vm.seed and e.publish_vm.vertical not in verts:
                raise ConfigError(f"experiment.publish_vm.vertical: {e.publish_vm.vertical} is not a vertical of the "
                                  f"data with a VM, seed {seed} ({verts})")
            self.verticals[seed] = verts
            sd = self.out / f"seed{seed}"
            key = data_key(cfg, data)
            fm = fm_key(cfg, key, seed)
            fm_dir = sd / f"fm-{fm}"
            self.fm_dirs[seed] = fm_dir
            follow = {"source": asdict(self._source()), "manifest": str(fm_dir / MANIFEST)}
            stores = {d: store_key(cfg, fm, d, verts) for d in e.staleness}
            self.stores[seed] = {d: sd / "das" / f"d{d}-{key}" for d, key in stores.items()}
            fm_tasks.append(Task(f"fm/s{seed}", "fm", {"config": cfg.to_dict(), "data": str(data),
                                                       "out_dir": str(fm_dir), "seed": seed},
                                 fm_dir / "result.json", seed=seed))
            base = dict(data=str(data), seed=seed, vm=asdict(cfg.vm), distill=asdict(cfg.distill),
                        stream=asdict(cfg.stream), das_wait_s=e.das_wait_s, on_missing=e.on_missing,
                        threads=e.threads, **follow)
            for v in verts:
                vd = sd / "vm" / f"v{v}"
                warm_key = warmup_key(cfg, key, seed, v)
                warm_dir = vd / f"warmup-{warm_key}"
                warm = VMJob.from_dict({**base, "out_dir": str(warm_dir), "phase": "warmup", "vertical": v})
                warm_tasks.append(Task(f"warm/s{seed}/v{v}", "vm", warm.to_dict(), warm_dir / "result.json",
                                       seed=seed))
                for arm in e.arms:
                    for d in ([-1] if arm == "alone" else e.staleness):
                        name = "alone" if arm == "alone" else f"{arm}_d{d}"
                        store = str(self.stores[seed][d]) if d >= 0 else ""
                        job = VMJob.from_dict({**base, "phase": "arm", "vertical": v, "arm": arm, "staleness": d,
                                               "store": store, "warm_dir": str(warm_dir)})
                        job.out_dir = str(vd / f"{name}-{arm_key(cfg, job, warm_key, stores.get(d, ''))}")
                        if e.publish_vm.matches(seed, v, arm, d):  # not in the key: publishing changes no result
                            pub = e.publish_vm
                            job.publish_root = str(Path(pub.root) if pub.root else self.out / "published")
                            job.publish_every_s, job.publish_tables = pub.every_s, pub.tables
                        deps = [f"warm/s{seed}/v{v}"] + ([f"fm/s{seed}"] if d >= 0 else [])
                        arm_tasks.append(Task(f"{name}/s{seed}/v{v}", "vm", job.to_dict(),
                                              Path(job.out_dir) / "result.json", deps, seed))
        return fm_tasks + warm_tasks + arm_tasks

    def _source(self) -> StreamSourceSpec:
        """The directory stream the tasks read (none: ``dir`` empty, they read a prepared set)."""
        return self.cfg.data.stream if self.cfg.data.source == "stream" else StreamSourceSpec()

    def _verticals(self, data: Path, seed: int) -> list[int]:
        """The verticals with a VM, after checking the data once here (every task of the seed reads it): a
        prepared set's values and windows; a stream's directory and schema (its windows are not known yet)."""
        cfg, e = self.cfg, self.cfg.experiment
        if cfg.data.source == "stream":
            DirectoryStream(data, cfg.data.stream.idle_s).check()
            SchemaPartitions(load_schema(cfg.data.stream.schema))  # refuses what a stream cannot encode
            return list(e.verticals)
        ds = PreparedDataset(data)
        check_values(ds)
        num_windows = len(make_windows(ds, cfg.stream))
        if num_windows <= cfg.stream.vm_start:
            raise ConfigError(
                f"stream.vm_start: the data of seed {seed} ({data}) has {num_windows} windows under [stream], "
                f"none from vm_start={cfg.stream.vm_start} on for the VMs to read FM labels and be evaluated "
                "on; use more data or longer windows, or a smaller stream.vm_start"
            )
        all_v = VerticalIndex(ds).verticals
        verts = [v for v in all_v if not e.verticals or v in e.verticals]
        if len(verts) == 0:
            raise ValueError(f"experiment.verticals: none of {e.verticals} is in the data ({all_v})")
        return verts

    def _start_das(self, seed: int) -> None:
        if seed in self.das:
            return
        sd = self.out / f"seed{seed}"
        feeds = [[str(path), d] for d, path in self.stores[seed].items()]
        job = DasJob(data=str(self.data[seed]), snapshots=str(self.fm_dirs[seed] / "snapshots"), feeds=feeds,
                     stream=self.cfg.stream, first_window=self.cfg.stream.vm_start, verticals=self.verticals[seed],
                     part_rows=self.cfg.experiment.das_part_rows, wait_s=self.cfg.experiment.das_wait_s,
                     threads=self.cfg.experiment.threads, source=self._source(),
                     manifest=str(self.fm_dirs[seed] / MANIFEST))
        sd.mkdir(parents=True, exist_ok=True)
        path = job.save(sd / "das_job.json")
        log = open(sd / "das.log", "a")  # the child keeps its own handle; ours is closed right away
        self.das[seed] = subprocess.Popen([sys.executable, "-m", "recstack.exfm.das", "--job", str(path),
                                           "--parent-pid", str(os.getpid())], stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _check_das(self, final: bool = False) -> None:
        for seed, proc in self.das.items():
            rc = proc.wait() if final else proc.poll()
            if rc not in (None, 0):
                log = self.out / f"seed{seed}" / "das.log"
                lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
                why = f"signal {-rc}" if rc < 0 else f"status {rc}"
                last = f"; its last line: {lines[-1][-300:]}" if lines else ""
                raise ServiceFailure(f"the data augmentation service (DAS) of seed {seed} died ({why}), so the "
                                     f"vertical models would wait for FM labels that never come; see {log}{last}")

    def run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
        tasks = self.plan()
        done = {t.key for t in tasks if t.result.is_file() and self._intact(t)}
        reused = len(done)
        pending = [t for t in tasks if t.key not in done]
        for seed in sorted({t.seed for t in pending if t.kind == "vm" and t.payload["staleness"] >= 0}):
            self._start_das(seed)  # on a rerun it skips the windows it has committed
        workers = self.cfg.experiment.workers
        t0 = time.perf_counter()
        self.log(f"exfm: {len(tasks)} tasks ({reused} reused from an earlier run of the same config, "
                 f"{len(pending)} to run), {workers} workers -> {self.out}")
        ctx = mp.get_context("spawn")  # no fork after torch has started its thread pools
        try:
            pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                       initargs=(self.cfg.experiment.threads, os.getpid()))
            try:
                running: dict[Future, Task] = {}
                while pending or running:
                    for t in list(pending):
                        if len(running) >= workers:
                            break
                        if all(d in done for d in t.deps):
                            pending.remove(t)
                            running[pool.submit(_run_task, t.kind, t.payload, self.publisher)] = t
                    finished, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                    self._check_das()
                    for f in finished:
                        t = running.pop(f)
                        try:
                            f.result()  # re-raises a task's error here
                        except BrokenProcessPool as e:  # a worker was killed (a signal, OOM)
                            why = _dead_worker([t, *running.values()], len(done))
                            raise ServiceFailure(why) from e
                        done.add(t.key)
                        self.log(f"  [{len(done)}/{len(tasks)}] {t.key} ({time.perf_counter() - t0:.0f} s)")
            except BaseException:
                # Fail fast: a running VM task may be waiting (das_wait_s) for a DAS that is gone. Python 3.11's
                # executor has no public way to stop its workers, so they are terminated through its table.
                for proc in list((getattr(pool, "_processes", None) or {}).values()):
                    proc.terminate()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            pool.shutdown(wait=True)
            self._check_das(final=True)
        finally:
            for proc in self.das.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return self.collect(tasks, time.perf_counter() - t0, len(tasks) - reused)

    def _intact(self, task: Task) -> bool:
        """Whether a task's result can be reused; a damaged one is renamed ``result.json.damaged``
        (kept for a look, never read again) and the task runs again, resuming from its last window
        checkpoint."""
        try:
            read_result(task)
            return True
        except ValueError as e:
            aside = task.result.with_name(task.result.name + ".damaged")
            os.replace(task.result, aside)
            self.log(f"exfm: {e}; moved to {aside.name}, task {task.key} runs again")
            return False

    def _vertical_names(self) -> list[str]:
        """Vertical names by id: a prepared set's, or those the FM's stream manifest numbered."""
        seed = self.cfg.experiment.seeds[0]
        if self.cfg.data.source == "stream":
            entries = json.loads((self.fm_dirs[seed] / MANIFEST).read_text(encoding="utf-8"))["entries"]
            names = list(entries[-1]["verticals"]) if entries else []
        else:
            names = PreparedDataset(self.data[seed]).info.get("verticals") or []
        return names or [f"v{v}" for v in range(max(max(v) for v in self.verticals.values()) + 1)]

    def collect(self, tasks: list[Task], seconds: float, tasks_run: int) -> dict[str, Any]:
        """Gather every task's result into one document and write the report. ``seconds``: wall time of
        this invocation, which ran ``tasks_run`` of the tasks (the others were reused from an earlier one)."""
        from recstack.exfm.report import write_report

        fm, vms, warm = {}, [], {}
        for t in tasks:
            res = read_result(t)
            if t.kind == "fm":
                fm[t.seed] = res
            elif t.payload["phase"] == "warmup":
                warm[(t.seed, t.payload["vertical"])] = res["records"]
            else:
                vms.append(res)
        for res in vms:
            j = res["job"]
            res["records"] = warm[(j["seed"], j["vertical"])] + res["records"]
        names = self._vertical_names()
        results = {"config": self.cfg.to_dict(), "seconds": seconds, "tasks_run": tasks_run,
                   "tasks_reused": len(tasks) - tasks_run, "vertical_names": names,
                   "fm": {str(s): r for s, r in fm.items()},
                   "vm": [{"seed": r["job"]["seed"], "vertical": r["job"]["vertical"], "arm": r["job"]["arm"],
                           "staleness": r["job"]["staleness"], "records": r["records"], "summary": r["summary"]}
                          for r in vms]}
        published = [r for r in vms if r["job"].get("publish_root")]
        if published:
            r = published[0]
            results["published_vm"] = {**{k: r["job"][k] for k in ("seed", "vertical", "arm", "staleness")},
                                       "root": r["job"]["publish_root"], "versions": r.get("published", [])}
        write_report(results, self.out)
        return results
