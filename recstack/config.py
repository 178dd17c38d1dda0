"""Typed configuration: dataclasses, TOML files, and ``--set section.key=value`` overrides.

A config file mirrors the dataclasses: ``[data]``, ``[model]``, ``[optim]``, ``[train]`` tables. Unknown keys
and values of the wrong type are errors that name the file and the key, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recstack.compression.config import CompressionConfig


class ConfigError(ValueError):
    """A config file or override names an unknown key or gives a value of the wrong type."""


@dataclass
class DataConfig:
    """Where training and evaluation rows come from.

    ``train``/``eval`` are prepared directories (``recstack data prepare`` / ``recstack data synth``). When
    ``eval`` is empty, the last ``eval_fraction`` of the training rows (the latest in time) are held out.
    A non-empty ``[data.synth]`` table generates a synthetic set into ``<output_dir>/data`` (or ``train``
    when given) before training, with those generator options (see ``recstack.data.synth.SynthConfig``).
    """

    train: str = ""
    eval: str = ""
    eval_fraction: float = 0.1
    synth: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    """DLRM architecture. ``bottom_mlp`` ends in ``embedding_dim`` for the dot interaction; ``top_mlp``
    ends in 1 (a logit). ``max_table_size`` caps every table's rows (0 = no cap); ids are taken modulo it.
    ``qr_collisions`` m >= 2 turns every table of more than ``qr_threshold`` rows into quotient-remainder
    tables (ceil(n / m) + m rows, combined by ``qr_operation``; ``recstack.embedding.qr``); 0 = off."""

    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    interaction: str = "dot"  # dot | cat | dcn
    interaction_itself: bool = False
    dcn_layers: int = 3
    dcn_low_rank: int = 512
    max_table_size: int = 0
    qr_collisions: int = 0
    qr_threshold: int = 200
    qr_operation: str = "mult"  # mult | add


@dataclass
class OptimConfig:
    """Dense part: ``dense`` in sgd | adagrad | adam. Embeddings: ``sparse`` in sgd | rowwise_adagrad,
    applied inside backward (no dense table gradient is built)."""

    dense: str = "sgd"
    dense_lr: float = 0.1
    sparse: str = "sgd"
    sparse_lr: float = 0.1
    eps: float = 1e-8
    adagrad_init: float = 0.0
    # Both learning rates x a schedule (recstack.training.lr_schedule): linear warm-up over lr_warmup_steps (the first
    # update at 1/lr_warmup_steps), then from lr_decay_start_step a quadratic decay to 0 over lr_decay_steps (0 =
    # none), as the DLRM reference.
    lr_warmup_steps: int = 0
    lr_decay_start_step: int = 0
    lr_decay_steps: int = 0


@dataclass
class TrainConfig:
    batch_size: int = 128
    epochs: int = 1
    max_steps: int = 0  # 0 = as many as the epochs give
    eval_every: int = 0  # steps; 0 = only at the end
    target_auc: float = 0.0  # stop at the first evaluation that reaches it (MLPerf's AUC threshold); 0 = never
    eval_batch_size: int = 16384
    log_every: int = 50
    checkpoint_every: int = 0  # steps; 0 = only the final checkpoint
    keep_checkpoints: int = 3
    shuffle: bool = False  # shuffle batch order per epoch (rows inside a batch stay contiguous)
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    progress: bool = True


@dataclass
class DistConfig:
    """Hybrid-parallel training under ``torchrun`` (ignored in a single process).

    ``plan`` is a sharding-plan JSON (``recstack plan --out``); without one every table gets ``sharding``
    (table_wise tables are dealt round-robin over the ranks). ``train.batch_size`` is per rank.
    """

    plan: str = ""
    sharding: str = "table_wise"
    forward_codec: str = "fp32"  # fp32 | fp16 | bf16 | fp8 | int8 | eb (error-bounded, see [compression])
    backward_codec: str = "fp32"
    aggregate_gradients: bool = False  # backward all-to-all: one row per distinct id of one-hot features
    timeout_s: float = 300.0
    ranks_per_node: int = 0  # 0 = LOCAL_WORLD_SIZE from torchrun
    pipeline: bool = True  # distribute the next batch's ids while the current batch computes


@dataclass
class MemoryConfig:
    """Embedding memory budgets (single process; see docs/memory_tiers.md). Sizes are bytes or strings such as
    ``"512MB"`` or ``"2GiB"``; ``""`` = no budget. With a budget set, tables that do not fit in ``device`` memory
    get a cache there over their rows in host memory (``host`` budget) or, past that, in a file in ``ssd_dir``."""

    device: int | str = ""
    host: int | str = ""
    ssd_dir: str = ""
    cache_policy: str = "lru"  # lru | lfu
    prefetch: bool = True  # fetch the next batch's rows while the current batch computes


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` converted to ``tp`` (int -> float allowed) or raise ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is types.NoneType:
        if value is not None:
            raise ConfigError(f"{where}: expected None, got {type(value).__name__} {value!r}")
        return value
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return [_check_type(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple and typing.get_args(tp)[-1] is Ellipsis:  # tuple[X, ...]: a list in TOML
        item_tp = typing.get_args(tp)[0]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_check_type(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__} {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        for alt in typing.get_args(tp):
            try:
                return _check_type(value, alt, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} matches none of {tp}")
    return value


def fill(obj: Any, values: dict[str, Any], where: str) -> None:
    """Set the fields of dataclass ``obj`` (nested dataclasses recursively) from ``values``, checking every key
    and type; errors name ``where`` and the key (``config.toml.model.embedding_dim: expected int ...``)."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{where}: unknown key {key!r} (valid: {', '.join(sorted(names))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}.{key}: expected a table")
            fill(current, value, f"{where}.{key}")
        else:
            setattr(obj, key, _check_type(value, hints[key], f"{where}.{key}"))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.embedding_dim=32"`` -> (["model", "embedding_dim"], 32). Values are TOML literals; anything
    that is not one (``train.device=cpu``) is taken as a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def load_into(cfg: Any, path: str | Path | None, overrides: list[str] | None) -> Any:
    """Fill the config dataclass ``cfg`` from the TOML file at ``path``, then from each ``section.key=value``
    override in order; returns ``cfg``. An override that reaches into a free-form table (a ``dict`` field such
    as ``data.synth``) sets that one key and keeps the table's others."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        try:
            values = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from e
        fill(cfg, values, str(p))
    for text in overrides or []:
        keys, value = parse_override(text)
        if not _set_in_table(cfg, keys, value, text):
            nested: dict[str, Any] = {keys[-1]: value}
            for k in reversed(keys[:-1]):
                nested = {k: nested}
            fill(cfg, nested, f"--set {text}")
    return cfg


def _set_in_table(cfg: Any, keys: list[str], value: Any, text: str) -> bool:
    """Apply an override whose path runs through a ``dict`` field; False when it does not."""
    obj = cfg
    for i, k in enumerate(keys[:-1]):
        if not dataclasses.is_dataclass(obj) or not hasattr(obj, k):
            return False
        current = getattr(obj, k)
        if isinstance(current, dict):
            table = current
            for sub in keys[i + 1 : -1]:
                table = table.setdefault(sub, {})
                if not isinstance(table, dict):
                    raise ConfigError(f"--set {text}: {sub!r} is not a table")
            table[keys[-1]] = value
            return True
        obj = current
    return False


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then each ``section.key=value`` override in order."""
    cfg = load_into(Config(), path, overrides)
    validate(cfg)
    return cfg


def config_from_dict(values: dict[str, Any], *, check_device: bool = False) -> Config:
    """A config from a dict (a checkpoint's saved config). ``train.device`` is checked for its form only unless
    ``check_device``: a model trained on a GPU can be loaded on a machine without one."""
    cfg = Config()
    fill(cfg, values, "config")
    validate(cfg, check_device=check_device)
    return cfg


def synth_config(values: dict[str, Any], where: str = "SynthConfig") -> Any:
    """``recstack.data.synth.SynthConfig`` from a table of its options; an unknown key, a value of the wrong
    type or out of range is a ConfigError naming ``where`` and the key (``data.synth.rows: must be >= 1``)."""
    from recstack.data.synth.generate import SynthConfig

    probe = SynthConfig()
    fill(probe, values, where)  # unknown keys and types, values converted (a TOML list to a tuple)
    try:
        cfg = SynthConfig(**{k: getattr(probe, k) for k in values})
        cfg.ctr_per_vertical()  # target_ctr x the vertical spread must stay below 1
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ConfigError(f"{where}.{msg.removeprefix('SynthConfig.')}" if msg.startswith("SynthConfig.")
                          else f"{where}: {msg}") from e
    return cfg


def check_device_name(name: str, check_available: bool, field: str = "train.device") -> None:
    """``field`` (``train.device``, or a command's ``--device``): auto | cpu | cuda | cuda:N; with
    ``check_available``, a CUDA device must exist here."""
    if name == "auto":
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConfigError(f"{field}: {name!r} is not one of auto, cpu, cuda, cuda:N") from e
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        raise ConfigError(f"{field}: {name!r} is not one of auto, cpu, cuda, cuda:N")
    if device.type == "cuda" and check_available:
        if not torch.cuda.is_available():
            raise ConfigError(f"{field}: {name!r} but CUDA is not available on this machine "
                              f"(use auto or cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{field}: {name!r} but this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s)")


def _check_ranges(cfg: Config) -> None:
    """Every numeric field within its range; each message names the field."""
    m, o, t, d = cfg.model, cfg.optim, cfg.train, cfg.dist
    at_least = {  # field -> (value, minimum)
        "model.dcn_layers": (m.dcn_layers, 0),
        "model.dcn_low_rank": (m.dcn_low_rank, 1),
        "model.max_table_size": (m.max_table_size, 0),
        "train.epochs": (t.epochs, 0),
        "train.max_steps": (t.max_steps, 0),
        "train.eval_every": (t.eval_every, 0),
        "train.log_every": (t.log_every, 1),
        "train.checkpoint_every": (t.checkpoint_every, 0),
        "train.keep_checkpoints": (t.keep_checkpoints, 0),  # 0 = keep all
        "train.threads": (t.threads, 0),
        "train.seed": (t.seed, 0),
        "dist.ranks_per_node": (d.ranks_per_node, 0),
    }
    for where, (value, low) in at_least.items():
        if value < low:
            raise ConfigError(f"{where}: must be >= {low}, got {value}")
    if t.seed > 2**32 - 1:  # numpy's seed range
        raise ConfigError(f"train.seed: must be <= 2**32 - 1, got {t.seed}")
    if t.epochs == 0 and t.max_steps == 0:
        raise ConfigError("train.epochs: 0 trains nothing (set train.epochs or train.max_steps)")
    for where, widths in (("model.bottom_mlp", m.bottom_mlp), ("model.top_mlp", m.top_mlp)):
        if any(w < 1 for w in widths):
            raise ConfigError(f"{where}: every width must be >= 1, got {widths}")
    for where, value in (("optim.dense_lr", o.dense_lr), ("optim.sparse_lr", o.sparse_lr),
                         ("optim.adagrad_init", o.adagrad_init)):
        if not 0.0 <= value < math.inf:
            raise ConfigError(f"{where}: must be finite and >= 0, got {value}")
    for where, value in (("optim.eps", o.eps), ("dist.timeout_s", d.timeout_s)):
        if not 0.0 < value < math.inf:
            raise ConfigError(f"{where}: must be finite and > 0, got {value}")


def validate(cfg: Config, *, check_device: bool = True) -> None:
    """Cross-field checks that the type system cannot express. ``check_device``: a CUDA ``train.device`` must
    exist on this machine (off for a saved config that is only loaded here)."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    codecs = ("fp32", "fp16", "bf16", "fp8", "int8", "eb")
    choices = {
        "model.interaction": (m.interaction, ("dot", "cat", "dcn")),
        "model.qr_operation": (m.qr_operation, ("mult", "add")),
        "optim.dense": (o.dense, ("sgd", "adagrad", "adam")),
        "optim.sparse": (o.sparse, ("sgd", "rowwise_adagrad")),
        "dist.sharding": (cfg.dist.sharding,
                          ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise")),
        "dist.forward_codec": (cfg.dist.forward_codec, codecs),
        "dist.backward_codec": (cfg.dist.backward_codec, codecs),
        "memory.cache_policy": (cfg.memory.cache_policy, ("lru", "lfu")),
    }
    for where, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
    if m.embedding_dim <= 0:
        raise ConfigError("model.embedding_dim: must be positive")
    _check_ranges(cfg)
    check_device_name(t.device, check_device)
    if cfg.data.synth:
        synth_config(cfg.data.synth, "data.synth")
    if m.qr_collisions < 0 or m.qr_collisions == 1 or m.qr_threshold < 0:
        raise ConfigError(f"model.qr_collisions / model.qr_threshold: need qr_collisions 0 (off) or >= 2 and "
                          f"qr_threshold >= 0, got {m.qr_collisions} / {m.qr_threshold}")
    if not m.top_mlp or m.top_mlp[-1] != 1:
        raise ConfigError(f"model.top_mlp: must end in 1 (a logit), got {m.top_mlp}")
    if m.interaction == "dot" and m.bottom_mlp and m.bottom_mlp[-1] != m.embedding_dim:
        raise ConfigError(
            f"model.bottom_mlp: the dot interaction needs it to end in embedding_dim={m.embedding_dim}, "
            f"got {m.bottom_mlp}"
        )
    if t.batch_size <= 0 or t.eval_batch_size <= 0:
        raise ConfigError("train.batch_size and train.eval_batch_size: must be positive")
    if not 0.0 <= t.target_auc < 1.0:
        raise ConfigError(f"train.target_auc: must be in [0, 1), got {t.target_auc}")
    if t.target_auc and not t.eval_every:
        raise ConfigError("train.target_auc: needs train.eval_every > 0 (the AUC is checked at each evaluation)")
    if cfg.dist.aggregate_gradients and cfg.dist.backward_codec == "eb" and cfg.compression.error_feedback:
        raise ConfigError("dist.aggregate_gradients: cannot be combined with compression.error_feedback (the rows "
                          "of an aggregated gradient belong to different ids every step, so no residual carries)")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction: must be in [0, 1), got {cfg.data.eval_fraction}")
    from recstack.training.lr_schedule import LRSchedule

    try:
        LRSchedule(o.lr_warmup_steps, o.lr_decay_start_step, o.lr_decay_steps)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    try:
        cfg.compression.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    from recstack.embedding.tiered.placement import parse_bytes  # here: the embedding package imports torch

    for key in ("device", "host"):
        try:
            parse_bytes(getattr(cfg.memory, key))
        except ValueError as e:
            raise ConfigError(f"memory.{key}: {e}") from e
