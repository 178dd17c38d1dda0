"""How batches reach the model: the one transform the data loader applies, and the ids distributed ahead.

The loader prepares batches in a background thread and runs one transform on each there
(``BatchLoader.transform``). ``InputPipeline`` composes it from what the model needs, in this order:

1. pipelined (``dist.pipeline``): move the batch to the device, in the loader's thread, on the rank's device;
2. the quotient-remainder split of the ids (``DLRM.split_batch``; a no-op without QR tables);
3. the cached tiers' prefetch hook (``EmbeddingCollection.next_batch_hook``), so their rows come in early;
4. pipelined: the sharded collection's input distribution (its id all-to-all, ``input_dist``) on a process
   group of its own, while the main thread trains on the previous batch. This is the only place where a
   collective runs outside the main thread. The ids each rank owns are then known a batch ahead, and go to
   its local shards (``ShardedEmbeddingCollection.announce``), so cached-tier shards prefetch their rows.

The routed ids (``RoutedIds``) do not ride on the batch: the loader's thread appends them to a FIFO here, in
batch order, and ``batches`` (main thread) hands each to the collection (``use_routed``) as it yields the batch
they were distributed for; the collection's forward checks that and uses them once. TorchRec's
``TrainPipelineSparseDist`` splits the same way: input_dist ahead, compute and output_dist in the step.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch

from recstack.data.batch import Batch
from recstack.distributed.sharded_collection import RoutedIds, ShardedEmbeddingCollection
from recstack.models.dlrm import DLRM


class InputPipeline:
    """The loader transforms of one model (``train_transform``, ``eval_transform``: None where there is nothing
    to do) and, pipelined, the hand-over of the ids distributed ahead (iterate training batches through
    ``batches``). ``pipelined`` needs a model whose collection is sharded."""

    def __init__(self, model: DLRM, device: torch.device, pipelined: bool = False) -> None:
        emb = model.embeddings
        if pipelined and not isinstance(emb, ShardedEmbeddingCollection):
            raise ValueError(f"dist.pipeline distributes ids ahead for sharded tables, not a {type(emb).__name__}")
        self.model, self.device, self.pipelined = model, device, pipelined
        self._sharded = emb if isinstance(emb, ShardedEmbeddingCollection) else None
        self._hook = emb.next_batch_hook()
        self._routed: deque[RoutedIds] = deque()  # appended by the loader's thread, taken by the main thread
        self._lock = threading.Lock()

    @property
    def train_transform(self) -> Callable[[Batch], Batch] | None:
        if not self.pipelined and self.model.qr is None and self._hook is None:
            return None
        return self._train

    @property
    def eval_transform(self) -> Callable[[Batch], Batch] | None:
        """Evaluation batches are split only: no prefetch (the hook expects the training order) and no ids
        ahead (evaluation runs its input distribution in the step)."""
        return self.model.split_batch if self.model.qr is not None else None

    def _train(self, batch: Batch) -> Batch:
        if self.pipelined:
            if self.device.type == "cuda":  # a new thread's current device is cuda:0: without this, rank r's
                torch.cuda.set_device(self.device)  # loader thread would make a CUDA context on GPU 0
            batch = batch.to(self.device)
        batch = self.model.split_batch(batch)
        if self._hook is not None:
            batch = self._hook(batch)
        if self._sharded is not None and self.pipelined:
            routed = self._sharded.input_dist(batch.sparse, self._sharded.pipeline_group)
            self._sharded.announce(routed)  # cached-tier shards start fetching this batch's rows early
            with self._lock:
                self._routed.append(routed)
        return batch

    def batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """The training batches of a loader whose transform is ``train_transform``; pipelined, each one's routed
        ids are handed to the collection as it is yielded (its forward follows). Routed ids of batches an earlier
        iteration read ahead but never yielded are dropped first."""
        if not self.pipelined:
            yield from batches
            return
        assert self._sharded is not None
        for batch in batches:
            routed = None
            with self._lock:  # its ids were routed last, after those of batches read ahead and never yielded
                while self._routed and routed is None:
                    head = self._routed.popleft()
                    routed = head if head.ids is batch.sparse.ids else None
            if routed is None:
                raise RuntimeError("pipelined input: a batch came without its routed ids (was the loader's "
                                   "transform the pipeline's train_transform?)")
            self._sharded.use_routed(routed)
            yield batch
