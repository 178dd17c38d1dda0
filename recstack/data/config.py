"""``[data]``: where the training and evaluation rows come from; ``synth_config`` checks a table of synthetic
generator options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recstack.errors import ConfigError
from recstack.typed_toml import fill

if TYPE_CHECKING:
    from recstack.data.synth.generate import SynthConfig


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

    def validate(self) -> None:
        """The generator options, when given, and ``eval_fraction``; a ConfigError names the field."""
        if self.synth:
            synth_config(self.synth, "data.synth")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction: must be in [0, 1), got {self.eval_fraction}")


def synth_config(values: dict[str, Any], where: str = "SynthConfig") -> SynthConfig:
    """``recstack.data.synth.SynthConfig`` from a table of its options; an unknown key, a value of the wrong
    type or out of range is a ConfigError naming ``where`` and the key (``data.synth.rows: must be >= 1``)."""
    from recstack.data.synth.generate import SynthConfig  # numpy and the click model: only when one is made

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
