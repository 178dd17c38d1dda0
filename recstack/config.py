"""The root configuration: one section per layer, put together and checked across sections.

A config file mirrors the dataclasses: ``[data]``, ``[model]``, ``[optim]``, ``[train]``, ``[dist]``,
``[memory]``, ``[compression]`` tables. Each section lives with the layer it configures and is all that layer
receives; only the trainer and the command line see the whole ``Config``. TOML and ``--set`` parsing is
``recstack.typed_toml`` (which also holds ``Literal`` fields to their choices); each section checks its own
ranges (``validate``), this module the rules across sections.
"""

from __future__ import annotations

import dataclasses
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


def validate(cfg: Config, *, check_device: bool = True) -> None:
    """Each section's own checks, then those across sections. ``check_device``: a CUDA ``train.device`` must
    exist on this machine (off for a saved config that is only loaded here)."""
    cfg.model.validate()
    cfg.train.validate(check_device)
    cfg.dist.validate()
    cfg.optim.validate()
    cfg.data.validate()
    try:
        cfg.compression.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    cfg.memory.validate()
    from recstack.embedding.sparse_optim import sparse_optimizer_config  # torch: only when a config is checked
    from recstack.embedding.tiered.collection import refuse_tiers
    from recstack.embedding.tiered.placement import memory_budgets_set

    if memory_budgets_set(cfg.memory):  # the tiers refuse it too; said here before any data is read
        budgets = f"memory.device={cfg.memory.device!r}, memory.host={cfg.memory.host!r}"
        try:
            refuse_tiers(sparse_optimizer_config(cfg.optim))
        except ConfigError as e:
            raise ConfigError(f"{e} ({budgets})") from e
        if cfg.optim.max_grad_norm > 0:  # TieredEmbeddingCollection.defer_updates
            raise ConfigError(f"optim.max_grad_norm = {cfg.optim.max_grad_norm} cannot be combined with memory "
                              f"tiers ({budgets}): set optim.max_grad_norm = 0, or hold the tables in memory")
    if cfg.optim.plateau_patience and not cfg.train.eval_every:
        raise ConfigError("optim.plateau_patience: needs train.eval_every > 0 (the metric is checked at each "
                          "evaluation)")
    if cfg.dist.aggregate_gradients and cfg.dist.backward_codec == "eb" and cfg.compression.error_feedback:
        raise ConfigError("dist.aggregate_gradients: cannot be combined with compression.error_feedback (the rows "
                          "of an aggregated gradient belong to different ids every step, so no residual carries)")
