"""``[compression]``: settings of the error-bounded all-to-all codec ``eb`` and of payload capture.

The codec is chosen per direction with ``dist.forward_codec = "eb"`` / ``dist.backward_codec = "eb"``; the
bounds below apply to every message it encodes. Defaults follow Feng et al. (SC'24): table classes by size
(largest tables 0.01, middle 0.03, smallest 0.05, relative to each message's value range; the thresholds
put the 8 largest Criteo Kaggle tables in the tight class and its 6 smallest in the loose one) and a
multiplier that decays from c = 2 to 1 over the first 65,536 iterations in 10 steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from recstack.errors import ConfigError

# The string choices, once: the fields below are typed with them, ``validate`` lists them, and the code that
# implements them (eb.bounds.multiplier, eb.core.encode) checks against them.
BoundMode = Literal["rel", "abs"]
Schedule = Literal["step", "linear", "log", "constant", "off"]
Lossless = Literal["auto", "zstd", "bitpack"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
LOSSLESS: tuple[str, ...] = get_args(Lossless)


@dataclass
class CompressionConfig:
    bound_mode: BoundMode = "rel"  # rel: bounds are fractions of each message's value range | abs: absolute
    tight_bound: float = 0.01  # tables with at least tight_min_rows rows
    base_bound: float = 0.03  # the others
    loose_bound: float = 0.05  # tables with at most loose_max_rows rows
    tight_min_rows: int = 50_000
    loose_max_rows: int = 25
    table_bounds: dict[str, Any] = field(default_factory=dict)  # table name -> bound, overrides its class
    schedule: Schedule = "step"  # step | linear | log | constant | off (iteration-level multiplier)
    schedule_c: float = 2.0  # the multiplier starts at c ...
    schedule_stage: int = 65536  # ... and reaches 1 after this many iterations
    backward_scale: float = 1.0  # backward (gradient) bounds = forward bounds * this
    error_feedback: bool = False  # backward: carry each chunk's compression error into the next step
    eval_lossless: bool = True  # evaluation passes send embeddings exactly: the model is judged, not the link
    lossless: Lossless = "auto"  # auto (zstd on CPU, bit packing on GPU) | zstd | bitpack
    dump_dir: str = ""  # save pooled embeddings and their gradients here (recstack train --dump-a2a)
    dump_steps: list[int] = field(default_factory=lambda: [1])  # at these steps (1 = the first)

    def validate(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"compression.{name}: {why}, got {getattr(self, name)!r}")

        if self.bound_mode not in get_args(BoundMode):
            raise bad("bound_mode", "must be rel or abs")
        for name in ("tight_bound", "base_bound", "loose_bound", "backward_scale"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise bad(name, "must be finite and >= 0")
        for name, value in self.table_bounds.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ConfigError(f"compression.table_bounds.{name}: must be a finite number >= 0, "
                                             f"got {value!r}")
        if self.tight_min_rows <= self.loose_max_rows:
            raise bad("tight_min_rows", f"must be larger than loose_max_rows={self.loose_max_rows}")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"must be one of {', '.join(SCHEDULES)}")
        if not 1.0 <= self.schedule_c < math.inf:
            raise bad("schedule_c", "must be finite and >= 1")
        if self.schedule_stage < 1:
            raise bad("schedule_stage", "must be >= 1")
        if self.lossless not in LOSSLESS:
            raise bad("lossless", "must be auto, zstd or bitpack")
        if any(s < 1 for s in self.dump_steps):
            raise bad("dump_steps", "steps count from 1")
