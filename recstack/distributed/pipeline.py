"""How batches reach the model: the one transform the data loader applies, and the ids distributed
ahead.

The loader prepares batches in a background thread and runs one transform on each there
(``BatchLoader.transform``). ``InputPipeline`` composes it from what the model needs, in this
order:

1. the quotient-remainder split of the ids (``DLRM.split_batch``; a no-op without QR tables);
2. the cached tiers' prefetch hook (``EmbeddingCollection.next_batch_hook``), so their rows come in
   early (not with dynamic id tables: their rows are known only after the remap in the training thread);
3. on a GPU: the batch is copied into pinned memory and on to the device with ``non_blocking``
   copies on a stream of the pipeline's own (the staging stream), so the copy overlaps the step
   before it;
4. pipelined (``dist.pipeline``): the sharded collection's messages of the input distribution are
   built (``prepare_input``: local work, no collective), on the device, on the staging stream.

The training thread takes each batch through ``batches``: it waits for the staging stream's event
of the batch (a GPU), then, pipelined, runs the id all-to-all of the *next* batch
(``exchange_input``) before it yields this one, and hands this one's routed ids to the collection
(``use_routed``). So the ids each rank owns are known a batch ahead, and go to its local shards
(``ShardedEmbeddingCollection.announce``): cached-tier shards prefetch their rows while the batch
before computes. No collective ever runs in the loader's thread: every rank issues every collective
from the training thread in one program order (NCCL orders a collective after the caller's current
stream; two threads issuing collectives on two groups could deadlock two ranks). TorchRec's
``TrainPipelineSparseDist`` splits the same way: input_dist a batch ahead, compute and output_dist
in the step.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from recstack.data.batch import Batch
from recstack.data.loader import BatchLoader, LoaderPosition
from recstack.distributed.input_dist import PreparedInput, RoutedIds
from recstack.distributed.sharded_collection import ShardedEmbeddingCollection
from recstack.embedding.dynamic_stage import DynamicIds
from recstack.models.dlrm import DLRM


@dataclass
class _Staged:
    """What the loader's thread prepared for one training batch: the batch's ids (its identity),
    the messages of its input distribution (pipelined) and the staging stream's event after its
    copy (a GPU)."""

    ids: torch.Tensor
    prepared: PreparedInput | None
    ready: torch.cuda.Event | None


class InputPipeline:
    """The loader transforms of one model (``train_transform``, ``eval_transform``: None where
    there is nothing to do) and the hand-over of staged batches and of the ids distributed ahead
    (iterate training batches through ``batches``). ``pipelined`` needs a model whose collection is
    sharded."""

    def __init__(self, model: DLRM, device: torch.device, pipelined: bool = False,
                 dynamic: DynamicIds | None = None) -> None:
        """``dynamic``: the id maps of dynamic id tables, applied to every training batch in the training thread
        as ``batches`` hands it over (admission must follow the step order exactly) and to evaluation batches in
        the loader's thread (lookups only, while no training step runs)."""
        emb = model.embeddings
        if pipelined and not isinstance(emb, ShardedEmbeddingCollection):
            kind = type(emb).__name__
            raise ValueError(
                f"dist.pipeline distributes ids ahead for sharded tables, not a {kind}"
            )
        self.model, self.device, self.pipelined, self.dynamic = model, device, pipelined, dynamic
        self._sharded = emb if isinstance(emb, ShardedEmbeddingCollection) else None
        # The cached tiers' prefetch reads the ids of a batch in the loader's thread; a dynamic table's ids are
        # raw there, its rows known only once the remap has run in this thread, just before the step (the rows
        # are then fetched at the batch's forward, after the remap's resets: ``embedding/tiered/reset.py``).
        self._hook = emb.next_batch_hook() if dynamic is None else None
        # a GPU: batches are staged through pinned memory on a stream of their own
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # appended by the loader's thread, taken by the training thread
        self._staged: deque[_Staged] = deque()
        self._lock = threading.Lock()

    @property
    def stages(self) -> bool:
        """Whether the loader's thread hands batches over through ``batches`` (a GPU, or
        pipelined)."""
        return self.pipelined or self._stream is not None

    @property
    def train_transform(self) -> Callable[[Batch], Batch] | None:
        if not self.stages and self.model.qr is None and self._hook is None:
            return None
        return self._train

    @property
    def eval_transform(self) -> Callable[[Batch], Batch] | None:
        """Evaluation batches are split only: no prefetch (the hook expects the training order) and
        no ids ahead (evaluation runs its input distribution in the step)."""
        if self.dynamic is not None:  # (no QR split: refused with dynamic ids)
            return None if self.dynamic.collective else self.dynamic.lookup_batch
        return self.model.split_batch if self.model.qr is not None else None

    @property
    def eval_step(self) -> Callable[[Batch], Batch] | None:
        """What the evaluating thread applies to each evaluation batch itself: sharded dynamic ids' lookups,
        a collective (never run in the loader's thread)."""
        return self.dynamic.lookup_batch if self.dynamic is not None and self.dynamic.collective else None

    def _train(self, batch: Batch) -> Batch:
        batch = self.model.split_batch(batch)
        if self._hook is not None:  # on the host ids: the tiers read them there
            batch = self._hook(batch)
        if not self.stages:
            return batch
        ready = None
        if self._stream is not None:
            # a new thread's current device is cuda:0 (a context on GPU 0)
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self._stream):
                batch = batch.pin_memory().to(self.device, non_blocking=True)
                prepared = self._prepare(batch)
                ready = torch.cuda.Event()
                ready.record(self._stream)
        else:
            batch = batch.to(self.device)
            prepared = self._prepare(batch)
        with self._lock:
            self._staged.append(_Staged(batch.sparse.ids, prepared, ready))
            # batches staged but never trained (a loader iterated elsewhere)
            while len(self._staged) > 64:
                self._staged.popleft()
        return batch

    def _prepare(self, batch: Batch) -> PreparedInput | None:
        return (
            self._sharded.prepare_input(batch.sparse)
            if self._sharded is not None and self.pipelined
            else None
        )

    def _take(self, batch: Batch) -> PreparedInput | None:
        """The training thread's side of a staged batch: its staging record (those of batches read
        ahead and never yielded are dropped first); on a GPU the current stream waits for its copy,
        and its tensors are marked used there (the allocator must not hand their memory to the
        staging stream while it computes)."""
        staged = None
        with self._lock:
            while self._staged and staged is None:
                head = self._staged.popleft()
                staged = head if head.ids is batch.sparse.ids else None
        if staged is None:
            raise RuntimeError(
                "input pipeline: a batch came that its loader's thread did not stage (was the "
                "loader's transform the pipeline's train_transform?)"
            )
        if staged.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(staged.ready)
            for t in _tensors(batch, staged.prepared):
                t.record_stream(current)
        return staged.prepared

    def batches(
        self, batches: Iterable[Batch], loader: BatchLoader | None = None
    ) -> Iterator[Batch]:
        """The training batches of a loader whose transform is ``train_transform``, in order.
        Pipelined, the id all-to-all of batch n + 1 runs (here, in the training thread) before
        batch n is yielded, and batch n's routed ids go to the collection as it is yielded (its
        forward follows). Reading batch n + 1 moved ``loader``'s position past it; while batch n is
        out, the position is put back to just after batch n, so a checkpoint written after its step
        resumes with batch n + 1 (the next read sets it again). Dynamic ids are remapped here, as each batch
        is handed over."""
        if self.dynamic is not None:
            remap = self.dynamic.remap_batch
            yield from (remap(b) for b in self._batches(batches, loader))
        else:
            yield from self._batches(batches, loader)

    def _batches(self, batches: Iterable[Batch], loader: BatchLoader | None) -> Iterator[Batch]:
        if not self.stages:
            yield from batches
            return
        if not self.pipelined:
            for batch in batches:
                self._take(batch)
                yield batch
            return
        sharded = self._sharded
        assert sharded is not None
        ahead: tuple[Batch, RoutedIds, LoaderPosition | None] | None = None
        for batch in batches:
            # the position just after this batch
            after = loader.position if loader is not None else None
            prepared = self._take(batch)
            assert prepared is not None
            routed = sharded.exchange_input(prepared)
            sharded.announce(routed)  # cached-tier shards start fetching this batch's rows early
            if ahead is not None:
                yield self._hand_over(ahead, loader)
            ahead = (batch, routed, after)
        if ahead is not None:
            yield self._hand_over(ahead, loader)

    def _hand_over(
        self, ahead: tuple[Batch, RoutedIds, LoaderPosition | None], loader: BatchLoader | None
    ) -> Batch:
        batch, routed, after = ahead
        if loader is not None and after is not None:
            loader.position = after
        assert self._sharded is not None
        self._sharded.use_routed(routed)
        return batch


def _tensors(batch: Batch, prepared: PreparedInput | None) -> list[torch.Tensor]:
    """Every tensor the staging stream made for a batch."""
    s = batch.sparse
    out = [batch.dense, batch.labels, s.ids, s.offsets, *batch.extras.values()]
    out += [s.weights] if s.weights is not None else []
    return out + (prepared.tensors() if prepared is not None else [])
