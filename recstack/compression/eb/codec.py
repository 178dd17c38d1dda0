"""``eb`` as an all-to-all codec: per-chunk bounds from the table the chunk carries and the iteration,
optional error feedback, and counters for metrics.jsonl.

The exchange hands every chunk over with a ``ChunkKey`` (phase, source, destination, position). A
``table_of`` function, bound by the trainer from the sharding, maps the key to the table index, and a
``DualLevelBound`` gives that table's bound at the current iteration. Chunks a rank sends to itself never
touch the network and are copied losslessly. With error feedback, the compression error of each chunk
(destination, position) is added to the same chunk of the next step, so that quantization errors of
gradients cancel over steps instead of accumulating in the weights. The residuals are training state of the
sending rank: ``residual_state`` / ``load_residual_state`` carry them through checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from recstack.compression.base import ChunkKey, Codec, CodecError
from recstack.compression.eb.bounds import DualLevelBound
from recstack.compression.eb.core import decode, encode_with_info, lossless_copy


class EbCodec(Codec):
    """Error-bounded codec. Without a policy every chunk gets ``bound`` (relative to the chunk's value
    range, or absolute with ``relative=False``)."""

    name = "eb"

    def __init__(self, bound: float = 0.03, relative: bool = True, lossless: str = "auto",
                 policy: DualLevelBound | None = None, error_feedback: bool = False) -> None:
        self.bound, self.relative, self.lossless = bound, relative, lossless
        self.policy = policy
        self.error_feedback = error_feedback
        self.table_of: Callable[[ChunkKey], int | None] | None = None
        self.iteration = 0
        self.lossless_now = False  # set while the model evaluates, when evaluation is to be exact
        self.residual: dict[tuple[str, int, int], torch.Tensor] = {}
        self._counters: dict[str, float] = {}

    def bind(self, table_of: Callable[[ChunkKey], int | None], policy: DualLevelBound | None = None) -> None:
        """Tell the codec which table each chunk carries (and, optionally, the bound policy)."""
        self.table_of = table_of
        if policy is not None:
            self.policy = policy

    def set_iteration(self, iteration: int) -> None:
        """The iteration about to run (0 = the first), for the iteration-level bound."""
        self.iteration = iteration

    def bound_for(self, key: ChunkKey | None) -> float:
        if self.policy is None:
            return self.bound
        table = self.table_of(key) if (self.table_of is not None and key is not None) else None
        if table is None:
            return self.policy.default_bound(self.iteration)
        return self.policy.bound(table, self.iteration)

    # -- error-feedback state ---------------------------------------------------------------------------------
    def residual_state(self) -> dict[str, torch.Tensor]:
        """Error-feedback residuals by chunk slot, keyed ``"<phase>/<dst>/<index>"`` (plain strings, so a
        ``weights_only`` checkpoint load accepts them) -> residual [N, D] float32."""
        return {f"{phase}/{dst}/{index}": r for (phase, dst, index), r in self.residual.items()}

    def load_residual_state(self, state: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
        """Replace the residuals with ``state`` (from ``residual_state``), moved to ``device`` when given."""
        residual: dict[tuple[str, int, int], torch.Tensor] = {}
        for name, r in state.items():
            phase, dst, index = name.rsplit("/", 2)
            residual[(phase, int(dst), int(index))] = r.to(device) if device is not None else r
        self.residual = residual

    def _count(self, name: str, value: float) -> None:
        self._counters[name] = self._counters.get(name, 0.0) + value

    # -- Codec interface --------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return encode_with_info(x, self.bound_for(None), self.relative, self.lossless)[0]

    def decode(self, payload: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        y = decode(payload)  # raises EbFormatError, a CodecError
        if tuple(y.shape) != tuple(shape):
            raise CodecError(f"eb: payload holds a {tuple(y.shape)} chunk, expected {tuple(shape)}")
        return y

    def encode_chunk(self, x: torch.Tensor, key: ChunkKey) -> torch.Tensor:
        if key.src == key.dst or self.lossless_now:
            return lossless_copy(x)  # stays on this rank (nothing to save), or an exact evaluation pass
        t0 = time.perf_counter()
        bound = self.bound_for(key)
        if self.error_feedback:
            slot = (key.phase, key.dst, key.index)
            carried = self.residual.get(slot)
            if carried is not None and carried.shape == x.shape:
                x = x + carried
            msg, info = encode_with_info(x, bound, self.relative, self.lossless, want_recon=True)
            assert info.recon is not None  # want_recon=True
            residual = x - info.recon
            if info.exceptions or info.layout == "raw":  # else every value was finite and within the bound
                residual = torch.nan_to_num(residual, nan=0.0, posinf=0.0, neginf=0.0)
            self.residual[slot] = residual
        else:
            msg, info = encode_with_info(x, bound, self.relative, self.lossless)
        self._count("encode_s", time.perf_counter() - t0)
        self._count("raw_bytes", info.raw_bytes)
        self._count("bytes", info.nbytes)
        self._count("chunks", 1)
        self._count("exact_values", info.exceptions)
        self._count("lossless_chunks", info.layout == "raw")
        return msg

    def decode_chunk(self, payload: torch.Tensor, shape: tuple[int, int], key: ChunkKey) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.decode(payload, shape)
        if key.src != key.dst:
            self._count("decode_s", time.perf_counter() - t0)
        return y

    # -- metrics ------------------------------------------------------------------------------------------------
    def swap_counters(self, counters: dict[str, float]) -> dict[str, float]:
        """Count into ``counters`` from now on and return the counters used so far (an evaluation pass counts
        apart from the training steps and is then dropped)."""
        old, self._counters = self._counters, counters
        return old

    def pop_metrics(self, prefix: str, steps: int = 1) -> dict[str, float]:
        """Per-step averages over the last ``steps`` steps (``<prefix>_ratio``, ``_bytes``, ``_raw_bytes``,
        ``_encode_s``, ``_decode_s``, ...) and the bounds in force now (``<prefix>_bound_<class>``)."""
        c, self._counters = self._counters, {}
        out = {f"{prefix}_{k}": v / max(steps, 1) for k, v in c.items()}
        if c.get("bytes"):
            out[f"{prefix}_ratio"] = c["raw_bytes"] / c["bytes"]
        if self.policy is not None:
            out[f"{prefix}_bound_multiplier"] = self.policy.multiplier(self.iteration)
            out.update({f"{prefix}_bound_{k}": v for k, v in self.policy.in_force(self.iteration).items()})
        else:
            out[f"{prefix}_bound"] = self.bound
        return out
