"""Typed configuration of an ExFM experiment (``configs/exfm_*.toml``).

Sections: ``[data]`` (the stream: synthetic, MovieLens, a prepared set or a directory stream), ``[stream]``
(windows, FM publishing, staleness schedule), ``[fm]`` and ``[vm]`` (each a ``model``/``optim`` pair in the
layout of ``recstack.config`` plus a batch size), ``[distill]`` (the losses of the VM arms) and ``[experiment]``
(arms x staleness x seeds, workers).
Unknown keys and wrong types are errors naming the file and the key, as for ``recstack train``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recstack.data.config import synth_config as checked_synth_config
from recstack.errors import ConfigError
from recstack.models.config import ModelConfig
from recstack.training.config import OptimConfig
from recstack.typed_toml import fill, load_into
from recstack.units import MAX_THREADS

if TYPE_CHECKING:
    from recstack.data.synth.generate import SynthConfig
    from recstack.exfm.movielens import MovieLensConfig

SOURCES = ("synth", "movielens", "prepared", "stream")
ARMS = ("alone", "distill", "distill_sa", "aux", "aux_sa")
ADAPTER_ARMS = ("distill_sa", "aux_sa")
ARM_TITLES = {
    "alone": "VM alone",
    "distill": "single-head distillation",
    "distill_sa": "single-head distillation + Student Adapter",
    "aux": "Auxiliary Head",
    "aux_sa": "Auxiliary Head + Student Adapter",
}


@dataclass
class StreamSourceSpec:
    """A directory stream (``recstack.data.stream.DirectoryStream``): partitions renamed into ``dir`` in the
    format of the schema file ``schema`` (its ``[columns]`` carry ``vertical`` and ``example_id``), each read once
    in name order as one window; the stream ends when no partition arrived for ``idle_s`` seconds."""

    dir: str = ""
    schema: str = ""
    idle_s: float = 60.0


@dataclass
class DataSpec:
    """``source = "synth"``: ``synth`` holds ``recstack.data.synth.SynthConfig`` fields (its ``seed`` is
    replaced per experiment seed when ``experiment.vary_data_seed``). ``source = "movielens"``: ``movielens``
    holds ``recstack.exfm.movielens.MovieLensConfig`` fields (``path`` to the files). ``source = "prepared"``:
    ``prepared`` is a prepared, time-ordered data set (``recstack data prepare``). ``source = "stream"``:
    ``stream`` is a directory stream whose partitions are the windows."""

    source: str = "synth"
    synth: dict[str, Any] = field(default_factory=dict)
    movielens: dict[str, Any] = field(default_factory=dict)
    prepared: str = ""
    stream: StreamSourceSpec = field(default_factory=StreamSourceSpec)


@dataclass
class StreamConfig:
    """Windows are ``window`` timestamp units long (synthetic data: days; MovieLens: seconds), or
    ``window_rows`` rows each when that is > 0. VMs train alone on windows [0, ``vm_start``) (a warm-up that
    every arm shares); from ``vm_start`` on they read FM labels. The FM publishes a snapshot after every
    ``publish_every`` windows; with staleness d, window t is labelled by the newest snapshot that has seen
    no window later than t - d - 1. ``max_windows`` > 0 stops the stream early."""

    window: float = 1.0
    window_rows: int = 0
    vm_start: int = 6
    publish_every: int = 1
    max_windows: int = 0


@dataclass
class NetSpec:
    """One model (FM or VM): a DLRM architecture, its optimizers and the batch size of its stream."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch_size: int = 256


@dataclass
class DistillConfig:
    """ExFM losses (h = binary cross-entropy on logits, y_F = sigmoid(FM logit)):

    serving head h(y_S, y); distillation ``weight`` * h(y_D, min(``alpha`` * y_F, 1)), whose gradient into the
    shared body is scaled by ``beta``; Student Adapter y_SA = MLP(FM logit) with ``sa_hidden`` units trained
    by h(y_SA, y), and ``sa_weight`` * h(y_D, stop_grad(sigmoid(y_SA))). ``sa_lr_scale`` multiplies the
    dense learning rate for the adapter's parameters."""

    weight: float = 1.0
    alpha: float = 1.0
    beta: float = 1.0
    sa_weight: float = 1.0
    sa_hidden: list[int] = field(default_factory=lambda: [16])
    sa_lr_scale: float = 1.0
    sa_target: str = "distill"  # the head that fits the adapter's output: distill | serving
    sa_fm_weight: float = -1.0  # the raw FM target's weight in the aux_sa arm; < 0: ``weight``

    def fm_weight(self, arm: str) -> float:
        """Weight of h(., min(alpha y_F, 1)) for ``arm``: none in ``distill_sa`` (the adapter's output takes
        the FM label's place), ``sa_fm_weight`` (when >= 0) in ``aux_sa``, else ``weight``."""
        if arm == "distill_sa":
            return 0.0
        return self.sa_fm_weight if arm == "aux_sa" and self.sa_fm_weight >= 0 else self.weight

    def adapter_weight(self, arm: str) -> float:
        """Weight of h(., stop_grad(sigmoid(y_SA))): ``weight`` in ``distill_sa`` (the same weight as the
        single-head arm's FM label, so that the two differ in the label only), ``sa_weight`` in ``aux_sa``."""
        return self.weight if arm == "distill_sa" else self.sa_weight


@dataclass
class PublishVMConfig:
    """``[experiment.publish_vm]``: publish one VM's serving head (body + serving head, what its vertical would
    serve) while it trains, into ``root`` as versions that ``recstack serve ROOT --watch ROOT`` follows (a full
    artifact, then deltas). The VM is the run (``vertical``, ``arm``, ``staleness``, ``seed``); ``staleness``
    -1 with ``arm = "alone"``. A version at the end of a window of the arm's stream (windows >= vm_start) once
    ``every_s`` seconds passed since the last one (0: every window), and the final state. ``root`` empty:
    ``<output dir>/published``; ``tables``: as ``recstack export --tables``. ``vertical`` -1: off."""

    vertical: int = -1
    arm: str = "alone"
    staleness: int = -1
    seed: int = 0
    root: str = ""
    every_s: float = 0.0
    tables: str = "fp32"

    @property
    def enabled(self) -> bool:
        return self.vertical >= 0

    def matches(self, seed: int, vertical: int, arm: str, staleness: int) -> bool:
        return self.enabled and (self.seed, self.vertical, self.arm, self.staleness) == (seed, vertical, arm,
                                                                                          staleness)


@dataclass
class ExperimentConfig:
    """``on_missing``: what a VM does with an example the DAS has not labelled once ``das_wait_s`` passed:
    ``error`` stops the run, ``drop`` leaves the example out of training and counts it in the report.
    ``verticals`` empty = every vertical of the data. ``workers`` processes train in parallel, each with
    ``threads`` torch threads."""

    arms: list[str] = field(default_factory=lambda: list(ARMS))
    staleness: list[int] = field(default_factory=lambda: [0, 1, 2, 4])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    verticals: list[int] = field(default_factory=list)
    vary_data_seed: bool = True
    workers: int = 2
    threads: int = 1
    das_wait_s: float = 1800.0
    das_part_rows: int = 4096
    on_missing: str = "error"
    chart_staleness: int = 2  # the staleness whose per-window NE is drawn large in ne_by_window.png
    publish_vm: PublishVMConfig = field(default_factory=PublishVMConfig)


@dataclass
class ExfmConfig:
    data: DataSpec = field(default_factory=DataSpec)
    stream: StreamConfig = field(default_factory=StreamConfig)
    fm: NetSpec = field(default_factory=NetSpec)
    vm: NetSpec = field(default_factory=NetSpec)
    distill: DistillConfig = field(default_factory=DistillConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def synth_config(values: dict[str, Any], seed: int | None = None) -> SynthConfig:
    """``data.synth`` as a checked ``SynthConfig`` (with ``seed`` in place of its own when given); unknown keys,
    wrong types and bad values are ``ConfigError``s naming ``data.synth`` and the key."""
    return checked_synth_config({**values, "seed": seed} if seed is not None else values, "data.synth")


def movielens_config(values: dict[str, Any]) -> MovieLensConfig:
    """``data.movielens`` as a checked ``MovieLensConfig``; errors are ``ConfigError``s naming the key."""
    from recstack.exfm.movielens import MovieLensConfig

    probe = MovieLensConfig()
    fill(probe, values, "data.movielens")
    try:
        return MovieLensConfig(**{k: getattr(probe, k) for k in values})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"data.{e}" if str(e).startswith("movielens.") else f"data.movielens: {e}") from e


def validate(cfg: ExfmConfig) -> None:
    """Cross-field checks; every message names the key."""
    s, e, d = cfg.stream, cfg.experiment, cfg.distill
    if cfg.data.source not in SOURCES:
        raise ConfigError(f"data.source: {cfg.data.source!r} is not one of {', '.join(SOURCES)}")
    if cfg.data.source == "movielens" and not cfg.data.movielens.get("path"):
        raise ConfigError("data.movielens.path: the MovieLens directory is required (scripts/fetch_movielens.py)")
    if cfg.data.source == "synth":
        synth_config(cfg.data.synth)
    elif cfg.data.source == "movielens":
        movielens_config(cfg.data.movielens)
    elif cfg.data.source == "prepared" and not cfg.data.prepared:
        raise ConfigError("data.prepared: the prepared data set's directory is required with data.source = "
                          "'prepared'")
    elif cfg.data.source == "stream":
        _validate_stream(cfg)
    if s.window <= 0 and s.window_rows <= 0:
        raise ConfigError("stream.window: must be positive (or set stream.window_rows)")
    if s.publish_every < 1:
        raise ConfigError(f"stream.publish_every: must be >= 1, got {s.publish_every}")
    if 0 < s.max_windows <= s.vm_start:
        raise ConfigError(
            f"stream.max_windows: {s.max_windows} windows leave none from stream.vm_start={s.vm_start} on, where "
            f"the VMs read FM labels and are evaluated; need max_windows > vm_start (or 0: every window)"
        )
    bad = [a for a in e.arms if a not in ARMS]
    if bad or not e.arms:
        raise ConfigError(f"experiment.arms: {bad or e.arms} not in {', '.join(ARMS)}")
    if "alone" not in e.arms:
        raise ConfigError("experiment.arms: 'alone' is needed, it is the baseline of every NE gain")
    if not e.staleness or min(e.staleness) < 0:
        raise ConfigError(f"experiment.staleness: needs values >= 0, got {e.staleness}")
    # The first VM window with FM labels must have a published snapshot under the largest staleness.
    if s.vm_start - max(e.staleness) < s.publish_every:
        raise ConfigError(
            f"stream.vm_start: {s.vm_start} windows leave no published FM snapshot for staleness "
            f"{max(e.staleness)} (publish_every={s.publish_every}); need vm_start >= "
            f"{max(e.staleness) + s.publish_every}"
        )
    if not e.seeds:
        raise ConfigError("experiment.seeds: at least one seed")
    if e.on_missing not in ("error", "drop"):
        raise ConfigError(f"experiment.on_missing: {e.on_missing!r} is not one of error, drop")
    if e.workers < 1 or e.threads < 1 or e.das_part_rows < 1:
        raise ConfigError("experiment.workers, experiment.threads, experiment.das_part_rows: must be >= 1")
    if e.threads > MAX_THREADS:
        raise ConfigError(f"experiment.threads: must be <= {MAX_THREADS}, got {e.threads}")
    if d.sa_target not in ("distill", "serving"):
        raise ConfigError(f"distill.sa_target: {d.sa_target!r} is not one of distill, serving")
    if d.weight < 0 or d.alpha <= 0 or d.beta < 0 or d.sa_weight < 0 or d.sa_lr_scale <= 0:
        raise ConfigError("distill: weight, beta, sa_weight must be >= 0; alpha, sa_lr_scale > 0")
    for name, spec in (("fm", cfg.fm), ("vm", cfg.vm)):
        if spec.batch_size < 1:
            raise ConfigError(f"{name}.batch_size: must be >= 1")
        try:
            spec.model.validate()  # its own sections' checks, as recstack train makes them
            spec.optim.validate()
        except ConfigError as err:
            raise ConfigError(f"{name}.{err}") from err
    if cfg.fm.model.dynamic_ids.enabled:  # the DAS rebuilds FM snapshots from their weights alone
        raise ConfigError("fm.model.dynamic_ids: the foundation model takes raw ids through fm.model.max_table_size "
                          "(hashing); dynamic id tables are for the vertical models ([vm.model.dynamic_ids])")
    _validate_publish(e)


def _validate_publish(e: ExperimentConfig) -> None:
    p, k = e.publish_vm, "experiment.publish_vm"
    if not p.enabled:
        return
    if p.arm not in e.arms:
        raise ConfigError(f"{k}.arm: {p.arm!r} is not one of experiment.arms ({', '.join(e.arms)})")
    want = [-1] if p.arm == "alone" else e.staleness
    if p.staleness not in want:
        raise ConfigError(f"{k}.staleness: {p.staleness} is not one of {want} (arm {p.arm!r}: "
                          f"{'-1, it reads no FM labels' if p.arm == 'alone' else 'experiment.staleness'})")
    if p.seed not in e.seeds:
        raise ConfigError(f"{k}.seed: {p.seed} is not one of experiment.seeds {e.seeds}")
    if e.verticals and p.vertical not in e.verticals:
        raise ConfigError(f"{k}.vertical: {p.vertical} is not one of experiment.verticals {e.verticals}")
    if not p.every_s >= 0:
        raise ConfigError(f"{k}.every_s: must be >= 0 (0: at every window end), got {p.every_s}")
    if p.tables not in ("fp32", "fp16", "int8", "int4"):  # serving's WIDTHS, checked before any task runs
        raise ConfigError(f"{k}.tables: {p.tables!r} is not one of fp32, fp16, int8, int4")


def _validate_stream(cfg: ExfmConfig) -> None:
    """A directory stream: its keys, and what a stream cannot know in advance."""
    st = cfg.data.stream
    for key in ("dir", "schema"):
        if not getattr(st, key):
            raise ConfigError(f"data.stream.{key}: required with data.source = 'stream' (recstack exfm run "
                              "--stream DIR --schema SCHEMA.toml)")
    if st.idle_s < 0:
        raise ConfigError(f"data.stream.idle_s: must be >= 0, got {st.idle_s:g}")
    if not cfg.experiment.verticals:
        raise ConfigError("experiment.verticals: a stream's verticals are not known before it ends; name the "
                          "vertical ids of the VMs (ids in order of first appearance in the stream)")


def load_exfm_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExfmConfig:
    """Defaults, then the TOML file, then each ``section.key=value`` override (as ``recstack train --set``);
    ``data.synth.KEY=...`` and ``data.movielens.KEY=...`` set one key of those tables."""
    cfg = load_into(ExfmConfig(), path, overrides)
    validate(cfg)
    return cfg


def exfm_config_from_dict(values: dict[str, Any]) -> ExfmConfig:
    cfg = ExfmConfig()
    fill(cfg, values, "config")
    validate(cfg)
    return cfg
