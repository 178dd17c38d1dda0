"""The root configuration: one section per layer, put together and checked across sections.

A config file mirrors the dataclasses: ``[data]``, ``[model]``, ``[optim]``, ``[train]``, ``[dist]``,
``[memory]``, ``[compression]`` tables. Each section lives with the layer it configures and is all that layer
receives; only the trainer and the command line see the whole ``Config``. TOML and ``--set`` parsing is
``recstack.typed_toml``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recstack.compression.config import CompressionConfig
from recstack.data.config import DataConfig
from recstack.distributed.config import DistConfig
from recstack.embedding.tiered.config import MemoryConfig
from recstack.errors import ConfigError
from recstack.models.config import ModelConfig
from recstack.training.config import OptimConfig, TrainConfig
from recstack.typed_toml import fill, load_into


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
    for where, (number, low) in at_least.items():
        if number < low:
            raise ConfigError(f"{where}: must be >= {low}, got {number}")
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
