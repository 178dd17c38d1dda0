"""All-to-all with variable-size messages, and the autograd-aware exchange of pooled embeddings.

Every message size is exchanged first (one int64 per peer), then the payloads with ``all_to_all_single``,
so codecs whose output size depends on the data (the error-bounded one) need no padding. Where both sides
can compute every size (the pooled exchange with a fixed-size codec: fp32/fp16/bf16/fp8/int8), the size
exchange and the per-chunk header are skipped, and fp32 sends the float buffer itself. Byte counts of
everything sent are accumulated in a ``CommStats`` for logging.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from recstack.compression.base import ChunkKey, Codec, CodecError
from recstack.compression.cast import CastCodec
from recstack.compression.registry import get_codec
from recstack.distributed.grad_aggregation import GradGroups, aggregate_flat, expand_flat


@dataclass
class CommStats:
    """Per-step counters: bytes this rank sent and seconds spent, by phase name. Thread-safe: the pipelined
    input distribution (loader thread) and DDP's all-reduce callbacks add to it too."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, phase: str, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.bytes_sent[phase] = self.bytes_sent.get(phase, 0) + nbytes
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        """Flat dict for metrics.jsonl (``bytes_<phase>``, ``time_<phase>``), then reset."""
        with self.lock:
            out: dict[str, float] = {f"bytes_{k}": float(v) for k, v in self.bytes_sent.items()}
            out.update({f"time_{k}": v for k, v in self.seconds.items()})
            self.bytes_sent.clear()
            self.seconds.clear()
        return out


def all_to_all_variable(
    send: list[torch.Tensor], group: dist.ProcessGroup | None, stats: CommStats | None = None, phase: str = "",
    recv_numel: list[int] | None = None,
) -> list[torch.Tensor]:
    """send[r]: 1-D tensor for rank r (any length, one dtype) -> recv[r]: what rank r sent to us.

    ``recv_numel`` (what each rank will send us, when the caller knows it) skips the size exchange."""
    t0 = time.perf_counter()
    dtype, device = send[0].dtype, send[0].device
    in_splits = [t.numel() for t in send]
    if recv_numel is None:
        send_sizes = torch.tensor(in_splits, dtype=torch.int64, device=device)
        recv_sizes = torch.empty_like(send_sizes)
        dist.all_to_all_single(recv_sizes, send_sizes, group=group)
        recv_numel = recv_sizes.tolist()
    flat_in = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
    recv = _all_to_all_flat(flat_in, in_splits, recv_numel, group, stats, phase, t0)
    return list(torch.split(recv, recv_numel))


def _all_to_all_flat(flat_in: torch.Tensor, in_splits: list[int], out_splits: list[int],
                     group: dist.ProcessGroup | None, stats: CommStats | None, phase: str, t0: float) -> torch.Tensor:
    """One ``all_to_all_single``: flat_in [sum(in_splits)] -> [sum(out_splits)], both rank-major. Counts the
    bytes that leave this rank and the seconds since ``t0`` under ``phase``."""
    flat_out = torch.empty(sum(out_splits), dtype=flat_in.dtype, device=flat_in.device)
    dist.all_to_all_single(flat_out, flat_in, out_splits, in_splits, group=group)
    if stats is not None:
        me = dist.get_rank(group)
        stats.add(phase, (sum(in_splits) - in_splits[me]) * flat_in.element_size(), time.perf_counter() - t0)
    return flat_out


def encode_chunks(codec: Codec, chunks: list[torch.Tensor], keys: list[ChunkKey] | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """Chunks [n_i, d_i] -> one uint8 message: header of int64 payload sizes, then the payloads. ``device``:
    where the message goes when there are no chunks (the chunks' device otherwise; default CPU)."""
    if keys is None:
        payloads = [codec.encode(c) for c in chunks]
    else:
        payloads = [codec.encode_chunk(c, k) for c, k in zip(chunks, keys, strict=True)]
    if chunks:
        device = chunks[0].device
    elif device is None:
        device = torch.device("cpu")
    header = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=device)
    return torch.cat([header.view(torch.uint8), *payloads]) if payloads else header.view(torch.uint8)


def decode_chunks(codec: Codec, message: torch.Tensor, shapes: list[tuple[int, int]],
                  keys: list[ChunkKey] | None = None) -> list[torch.Tensor]:
    k = len(shapes)
    if message.numel() < 8 * k:
        raise CodecError(f"{codec.name}: message of {message.numel()} bytes is shorter than its header")
    head = message[: 8 * k]
    if head.storage_offset() % 8:  # messages of data-dependent size start anywhere in the receive buffer
        head = head.clone()
    sizes = head.view(torch.int64).tolist()
    if any(s < 0 for s in sizes) or 8 * k + sum(sizes) != message.numel():
        raise CodecError(f"{codec.name}: header sizes {sizes} do not match a {message.numel()}-byte message")
    out, pos = [], 8 * k
    for i, (size, shape) in enumerate(zip(sizes, shapes, strict=True)):
        payload = message[pos : pos + size]
        out.append(codec.decode(payload, shape) if keys is None else codec.decode_chunk(payload, shape, keys[i]))
        pos += size
    return out


class PooledExchange:
    """Static description of one pooled all-to-all: which chunks go to and come from each rank.

    send_shapes[r]: shapes [n, d] of the chunks this rank sends to rank r, in order;
    recv_shapes[r]: shapes of the chunks it receives from rank r, in order.
    """

    def __init__(
        self,
        send_shapes: list[list[tuple[int, int]]],
        recv_shapes: list[list[tuple[int, int]]],
        group: dist.ProcessGroup | None,
        forward_codec: str | Codec = "fp32",
        backward_codec: str | Codec = "fp32",
        stats: CommStats | None = None,
    ) -> None:
        self.send_shapes, self.recv_shapes = send_shapes, recv_shapes
        self.group = group
        self.fwd, self.bwd = get_codec(forward_codec), get_codec(backward_codec)
        self.stats = stats
        # (send, receive) gradient groups per [rank][chunk] for the backward exchange (grad_aggregation.py):
        # send for the chunks this rank received, receive for those it sent; None: every chunk per sample.
        self.grad_groups: GradGroups | None = None

    @staticmethod
    def _split(flat: torch.Tensor, shapes: list[list[tuple[int, int]]]) -> list[list[torch.Tensor]]:
        sizes = [n * d for per_rank in shapes for n, d in per_rank]
        pieces = iter(torch.split(flat, sizes))
        return [[next(pieces).view(n, d) for n, d in per_rank] for per_rank in shapes]

    def exchange(
        self, flat: torch.Tensor, out_shapes: list[list[tuple[int, int]]], in_shapes: list[list[tuple[int, int]]],
        codec: Codec, phase: str,
    ) -> torch.Tensor:
        if isinstance(codec, CastCodec) and codec.dtype == flat.dtype == torch.float32:  # identity: the buffer
            # is the message (decoders return float32, so only a float32 buffer passes through unchanged)
            return self._exchange_uncoded(flat, out_shapes, in_shapes, phase)
        chunks = self._split(flat, out_shapes)
        me = dist.get_rank(self.group)  # chunk keys let a codec tell tables and steps apart
        send_keys = [[ChunkKey(phase, me, r, i) for i in range(len(c))] for r, c in enumerate(chunks)]
        recv_keys = [[ChunkKey(phase, r, me, i) for i in range(len(s))] for r, s in enumerate(in_shapes)]
        recv_bytes = [[codec.payload_bytes(s) for s in per_rank] for per_rank in in_shapes]
        if all(b is not None for per_rank in recv_bytes for b in per_rank):
            # Fixed-size payloads: both sides know every size, so no header and no size exchange.
            messages = [torch.cat([codec.encode_chunk(x, k) for x, k in zip(c, keys, strict=True)])
                        if c else flat.new_zeros(0, dtype=torch.uint8)
                        for c, keys in zip(chunks, send_keys, strict=True)]
            received = all_to_all_variable(messages, self.group, self.stats, phase,
                                           recv_numel=[sum(per_rank) for per_rank in recv_bytes])  # type: ignore[arg-type]
            decoded = [codec.decode_chunk(p, s, k)
                       for m, sizes, shapes, keys in zip(received, recv_bytes, in_shapes, recv_keys, strict=True)
                       for p, s, k in zip(torch.split(m, sizes), shapes, keys, strict=True)]  # type: ignore[arg-type]
        else:
            # empty messages on the buffer's device too: all_to_all_variable concatenates every message, and
            # NCCL takes CUDA tensors only
            messages = [encode_chunks(codec, c, keys, flat.device) for c, keys in zip(chunks, send_keys, strict=True)]
            received = all_to_all_variable(messages, self.group, self.stats, phase)
            decoded = [t for r, m in enumerate(received)
                       for t in decode_chunks(codec, m, in_shapes[r], recv_keys[r])]
        if not decoded:
            return flat.new_zeros(0)
        return torch.cat([t.reshape(-1) for t in decoded])

    def _exchange_uncoded(self, flat: torch.Tensor, out_shapes: list[list[tuple[int, int]]],
                          in_shapes: list[list[tuple[int, int]]], phase: str) -> torch.Tensor:
        """The rank-major float32 buffer sent as it is: no encode, copy or decode."""
        t0 = time.perf_counter()
        in_splits = [sum(n * d for n, d in per_rank) for per_rank in out_shapes]
        out_splits = [sum(n * d for n, d in per_rank) for per_rank in in_shapes]
        return _all_to_all_flat(flat.contiguous(), in_splits, out_splits, self.group, self.stats, phase, t0)

    def __call__(self, send_flat: torch.Tensor) -> torch.Tensor:
        """send_flat: all outgoing chunks, flattened, rank-major -> all incoming chunks, flattened, rank-major."""
        return _PooledAllToAll.apply(send_flat, self)


class _PooledAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_flat: torch.Tensor, ex: PooledExchange) -> torch.Tensor:
        ctx.ex = ex
        return ex.exchange(send_flat, ex.send_shapes, ex.recv_shapes, ex.fwd, "fwd_a2a")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ex: PooledExchange = ctx.ex
        if ex.grad_groups is None:
            return ex.exchange(grad.contiguous(), ex.recv_shapes, ex.send_shapes, ex.bwd, "bwd_a2a"), None
        send_groups, recv_groups = ex.grad_groups
        # this rank's gradients of the chunks it received [B_r, d] -> [U, d] sums where grouped
        flat, sizes = aggregate_flat(grad.contiguous(), [s for per_rank in ex.recv_shapes for s in per_rank],
                                     [g for per_rank in send_groups for g in per_rank])
        it = iter(sizes)
        out_shapes = [[next(it) for _ in per_rank] for per_rank in ex.recv_shapes]
        in_shapes = [[(g.first.numel(), d) if g is not None else (n, d)
                      for (n, d), g in zip(per_rank, groups, strict=True)]
                     for per_rank, groups in zip(ex.send_shapes, recv_groups, strict=True)]
        recv = ex.exchange(flat, out_shapes, in_shapes, ex.bwd, "bwd_a2a")
        return expand_flat(recv, [s for per_rank in in_shapes for s in per_rank],
                           [g for per_rank in recv_groups for g in per_rank]), None
