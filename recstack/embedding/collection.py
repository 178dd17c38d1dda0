"""The embedding-collection interface and its single-device implementation.

Every collection (this fused one, the sharded ones in ``recstack.distributed``, the tiered ones with caches)
maps ``SparseFeatures`` (F features, batch B) to pooled embeddings [B, F, D] and updates its own rows during
backward. Nothing here knows about processes or devices other than its own.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recstack.data.batch import Batch, SparseFeatures
from recstack.embedding.sparse_optim import SparseOptimizer, SparseOptimizerConfig


@dataclass(frozen=True)
class TableConfig:
    """One embedding table. Several features may share it (``features`` lists their indices)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    features: tuple[int, ...]


def init_table(table: TableConfig, seed: int, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DLRM reference init, uniform(-1/sqrt(rows), 1/sqrt(rows)), from a generator seeded per table so
    that every placement (one device, sharded, tiered) builds bit-identical rows. -> [rows, dim] (rows may be
    0: an empty row shard)."""
    w = torch.empty(table.num_embeddings, table.embedding_dim, dtype=dtype)
    if table.num_embeddings == 0:  # an empty row shard (more row blocks than rows): nothing to draw
        return w
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    bound = table.num_embeddings**-0.5
    return w.uniform_(-bound, bound, generator=g)


class EmbeddingCollection(nn.Module, abc.ABC):
    """Pooled (sum) lookups of F features into tables of one common dim D."""

    def __init__(self, tables: list[TableConfig], optimizer: SparseOptimizerConfig) -> None:
        super().__init__()
        self.tables = list(tables)
        dims = {t.embedding_dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"all tables need one embedding_dim, got {sorted(dims)}")
        self.embedding_dim = dims.pop()
        feature_table: dict[int, int] = {}
        for ti, t in enumerate(tables):
            for f in t.features:
                if f in feature_table:
                    raise ValueError(f"feature {f} is mapped to tables {feature_table[f]} and {ti}")
                feature_table[f] = ti
        self.num_features = len(feature_table)
        if sorted(feature_table) != list(range(self.num_features)):
            raise ValueError(f"features must be numbered 0..F-1, got {sorted(feature_table)}")
        self.feature_table = [feature_table[f] for f in range(self.num_features)]
        self.optimizer = SparseOptimizer(optimizer)

    @abc.abstractmethod
    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        """-> pooled embeddings [B, F, D]; in training with grad enabled, backward updates the rows."""

    @abc.abstractmethod
    def table_weight(self, name: str) -> torch.Tensor:
        """The full weight [rows, D] of one table (a copy where the table is not held whole)."""

    # -- optional capabilities: every collection has them, most as the no-ops below ---------------------------
    # Whether the rows live in table files (cached tiers) rather than in the module's state dict: such a
    # collection's checkpoint is a directory with ``checkpoint_files`` beside the state, read by ``restore_files``.
    stores_rows_in_files: bool = False

    def next_batch_hook(self) -> Callable[[Batch], Batch] | None:
        """A function the loader calls on each batch ahead of its step (in its prefetch thread), so that the
        collection can fetch the batch's rows early; None when it has no use for that."""
        return None

    def pop_comm_stats(self) -> dict[str, float]:
        """Bytes and seconds per collective since the last call (``{"<phase>_bytes": ..., "<phase>_s": ...}``);
        empty for a collection that does not communicate."""
        return {}

    def wire_layout(self) -> list[list[tuple[int, int, int, int, int, int]]] | None:
        """For a collection that sends pooled embeddings between ranks: per owner rank, what each chunk of its
        messages carries, ``(feature, table, row0, row1, col0, col1)`` in message order; None otherwise."""
        return None

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]] | None:
        """{relative path: writer} of the files a checkpoint holds beside the state (``stores_rows_in_files``)."""
        return None

    def restore_files(self, directory: str | Path | None) -> None:
        """Load the rows from a checkpoint directory's ``checkpoint_files``; a no-op for in-memory rows."""

    def restore_tensors(self, weight: torch.Tensor, accumulator: torch.Tensor | None) -> None:
        """Load the rows from an all-in-memory collection's state (weight [sum of rows, D], row-wise
        accumulator [sum of rows] or None), for a collection whose rows are not in its state dict."""
        raise NotImplementedError(f"{type(self).__name__} holds its rows in its state dict")

    def close(self) -> None:
        """Release what the collection holds besides memory (threads, open files); lookups fail afterwards."""


class _FusedLookup(torch.autograd.Function):
    """Pooled lookup whose backward updates the table in place and returns no weight gradient.

    ``anchor`` is an empty tensor with requires_grad so that autograd calls backward even though the weight
    itself is not a parameter (it must not be: DDP and the dense optimizer would then see it).
    """

    @staticmethod
    def forward(ctx, anchor, module, rows, offsets, per_sample_weights):
        out = F.embedding_bag(
            rows, module.weight, offsets, mode="sum", per_sample_weights=per_sample_weights,
            include_last_offset=True,
        )
        ctx.module = module
        ctx.save_for_backward(rows, offsets, per_sample_weights)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rows, offsets, psw = ctx.saved_tensors
        module: FusedEmbeddingBagCollection = ctx.module
        # grad_out [bags, D]; each id receives the gradient of the bag it was pooled into.
        lengths = offsets[1:] - offsets[:-1]
        if rows.numel() == lengths.numel() and bool((lengths == 1).all()):  # one id per bag: bag i holds id i
            grads = grad_out
        else:  # as many ids as bags is not enough: [2, 0, 1, 1] has that too
            bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths,
                                          output_size=rows.numel())
            grads = grad_out.index_select(0, bag)
        if psw is not None:
            grads = grads * psw.unsqueeze(1)
        module.apply_gradients(rows, grads)
        # None for the anchor: it only exists to get this backward called, nothing reads its gradient.
        return None, None, None, None, None


class FusedEmbeddingBagCollection(EmbeddingCollection):
    """All tables in one weight [sum(rows), D]; one embedding_bag call for all features.

    Row offsets per table turn a feature's local id into a row of the concatenated weight, so the whole
    batch is looked up and updated with a constant number of kernels instead of one per table.
    """

    # buffers, declared for the type checker (nn.Module's __getattr__ would type them Tensor | Module)
    weight: torch.Tensor  # [R, D]
    accumulator: torch.Tensor | None  # [R]
    table_offsets: torch.Tensor  # [T + 1]
    feature_offsets: torch.Tensor  # [F]

    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: SparseOptimizerConfig,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(tables, optimizer)
        # On ``device`` like the weight: a collection built after its model was moved there (the sharded
        # collection's local tables) is never moved, and a CPU feature_offsets fails against CUDA ids.
        sizes = torch.tensor([t.num_embeddings for t in tables], dtype=torch.int64, device=device)
        table_offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        self.register_buffer("table_offsets", table_offsets, persistent=False)  # [T + 1]
        self.register_buffer(
            "feature_offsets", table_offsets[self.feature_table].clone(), persistent=False
        )  # [F] first row of each feature's table
        weight = torch.cat([init_table(t, seed, i) for i, t in enumerate(tables)]).to(device)
        self.register_buffer("weight", weight)  # [R, D]
        acc = None
        if self.optimizer.needs_accumulator:
            acc = torch.full(
                (weight.shape[0],), optimizer.initial_accumulator_value, dtype=torch.float32, device=device
            )
        self.register_buffer("accumulator", acc)  # [R] or None
        self._anchor = torch.zeros(0, device=device)

    def global_rows(self, sparse: SparseFeatures) -> torch.Tensor:
        """Local ids [N] (feature-major) -> rows of the concatenated weight [N]."""
        per_feature = sparse.ids_per_feature  # [F]
        return sparse.ids + self.feature_offsets.repeat_interleave(per_feature, output_size=sparse.ids.numel())

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        if sparse.num_features != self.num_features:
            raise ValueError(f"got {sparse.num_features} sparse features, collection has {self.num_features}")
        rows = self.global_rows(sparse)
        b, f = sparse.batch_size, sparse.num_features
        if self.training and torch.is_grad_enabled():
            anchor = self._anchor.detach().requires_grad_()
            pooled = _FusedLookup.apply(anchor, self, rows, sparse.offsets, sparse.weights)
        else:
            pooled = F.embedding_bag(
                rows, self.weight, sparse.offsets, mode="sum", per_sample_weights=sparse.weights,
                include_last_offset=True,
            )
        return pooled.view(f, b, self.embedding_dim).transpose(0, 1)  # [F*B, D] -> [B, F, D] (B may be 0)

    def apply_gradients(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """rows [N] of the concatenated weight (may repeat), grads [N, D]: one optimizer update.
        Subclasses that must combine gradients across processes first (replicated tables) override this."""
        self.optimizer.step(self.weight, self.accumulator, rows, grads)

    def table_weight(self, name: str) -> torch.Tensor:
        i = next(i for i, t in enumerate(self.tables) if t.name == name)
        return self.weight[self.table_offsets[i] : self.table_offsets[i + 1]]
