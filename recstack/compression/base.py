"""The codec interface for all-to-all messages: one interface for every wire format.

A codec turns a float tensor chunk [N, D] into a self-contained uint8 payload and back. The plain casts
(fp16, bf16, fp8 e4m3 with a per-row scale, int8 row-wise with per-row scale and offset) are in ``cast``, the
error-bounded lossy codec in ``eb``; ``registry.get_codec`` finds one by name. Payloads are on the tensor's
device: nothing here copies to the host.

A payload handed to ``decode`` may start at any byte: messages are concatenated behind a header of sizes,
and the messages received from all ranks are consecutive slices of one buffer, so an odd-sized payload
(fp8 or int8 with N * D odd, most error-bounded messages) shifts everything after it. Decoders therefore
read multi-byte fields through ``view_bytes_as``, which views in place when the bytes are aligned and
copies them otherwise.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from recstack.errors import RecstackError


class CodecError(RecstackError, ValueError):
    """A payload does not decode to the expected shape (corrupt, truncated or from another codec)."""


@dataclass(frozen=True)
class ChunkKey:
    """Where a chunk travels: all-to-all phase (``fwd_a2a``/``bwd_a2a``), sending and receiving rank, and
    its position in the message. Codecs that adapt per table or keep per-chunk state look at it."""

    phase: str
    src: int
    dst: int
    index: int


def view_bytes_as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes [k * itemsize] -> [k] of ``dtype``: a view when ``data`` starts on a multiple of the element
    size, else a view of an aligned copy (on the same device; ``Tensor.view(dtype)`` refuses misaligned
    storage offsets, and some kernels need aligned addresses). The caller checks the length."""
    size = torch.empty(0, dtype=dtype).element_size()
    if size > 1 and (data.storage_offset() % size or data.data_ptr() % size):
        data = data.clone()  # a fresh allocation is aligned for every dtype
    return data.view(dtype)


class Codec(abc.ABC):
    """A wire format for chunks [N, D] float32; ``name`` is what ``dist.forward_codec`` / ``backward_codec``
    call it."""

    name: str = ""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] float32 -> payload [bytes] uint8."""

    @abc.abstractmethod
    def decode(self, payload: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """payload [bytes] uint8 -> [N, D] float32 (``shape`` is known to both sides)."""

    def payload_bytes(self, shape: tuple[int, int]) -> int | None:
        """Payload size of a chunk of ``shape`` when it does not depend on the data (both sides then know
        every message size and the all-to-all skips the size exchange); None when it does."""
        return None

    def encode_chunk(self, x: torch.Tensor, key: ChunkKey) -> torch.Tensor:
        """``encode`` for chunk ``key`` of an all-to-all; stateless codecs ignore the key."""
        return self.encode(x)

    def decode_chunk(self, payload: torch.Tensor, shape: tuple[int, int], key: ChunkKey) -> torch.Tensor:
        return self.decode(payload, shape)

    def _check(self, payload: torch.Tensor, want: int) -> None:
        if payload.numel() != want:
            raise CodecError(f"{self.name}: payload of {payload.numel()} bytes, expected {want}")
