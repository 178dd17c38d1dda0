"""The single-device embedding collection: all tables in one weight, one ``embedding_bag`` for all features."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from recstack.data.batch import SparseFeatures
from recstack.embedding.collection import EmbeddingCollection, TableConfig, init_block
from recstack.embedding.sparse_optim import SparseOptimizerConfig

# (table index i, out [rows_i, D]) -> None: writes table i's initial rows into ``out`` (a view of the weight,
# on the collection's device): how a collection of parts of tables (the sharded collection's local shards) gets
# the values of the whole tables, one chunk at a time.
TableInit = Callable[[int, torch.Tensor], None]


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
    accumulator: torch.Tensor | None  # [R] with row-wise Adagrad (Adam's state: ``optimizer_state``)
    table_offsets: torch.Tensor  # [T + 1]
    feature_offsets: torch.Tensor  # [F]

    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: SparseOptimizerConfig,
        seed: int = 0,
        device: torch.device | str = "cpu",
        init: TableInit | None = None,
    ) -> None:
        """Rows of ``init_table`` with ``seed`` (drawn in chunks straight into the weight), or from ``init`` when
        given; on the ``meta`` device no values at all (a model whose tables will be sharded: only their shapes
        are needed)."""
        super().__init__(tables, optimizer)
        # On ``device`` like the weight: a collection built after its model was moved there (the sharded
        # collection's local tables) is never moved, and a CPU feature_offsets fails against CUDA ids.
        sizes = torch.tensor([t.num_embeddings for t in tables], dtype=torch.int64, device=device)
        table_offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        self.register_buffer("table_offsets", table_offsets, persistent=False)  # [T + 1]
        self.register_buffer(
            "feature_offsets", table_offsets[self.feature_table].clone(), persistent=False
        )  # [F] first row of each feature's table
        weight = torch.empty(sum(t.num_embeddings for t in tables), self.embedding_dim, device=device)
        if weight.device.type != "meta":  # in place, chunk by chunk: never a table beside the weight
            r0 = 0
            for i, t in enumerate(tables):
                rows = weight[r0 : r0 + t.num_embeddings]
                if init is not None:
                    init(i, rows)
                else:
                    init_block(t, seed, i, (0, t.num_embeddings), (0, t.embedding_dim), out=rows)
                r0 += t.num_embeddings
        self.register_buffer("weight", weight)  # [R, D]
        self.register_buffer("accumulator", None)  # [R] with row-wise Adagrad, set below
        for name, value in self.optimizer.new_state(weight.shape[0], self.embedding_dim, device).items():
            self.register_buffer(name, value)  # the optimizer's state_parts: [R] or [R, D]
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
        self.optimizer.step(self.weight, self.optimizer_state(), rows, grads)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """{part name: [R] or [R, D]} of the optimizer's ``state_parts``, the buffers themselves."""
        return {p.name: getattr(self, p.name) for p in self.optimizer.state_parts}

    def table_weight(self, name: str) -> torch.Tensor:
        i = next(i for i, t in enumerate(self.tables) if t.name == name)
        return self.weight[self.table_offsets[i] : self.table_offsets[i + 1]]

    resets_rows = True

    @torch.no_grad()
    def reset_rows(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        i = next(i for i, t in enumerate(self.tables) if t.name == name)
        at = rows.to(self.weight.device) + self.table_offsets[i]  # [k] rows of the concatenated weight
        self.weight[at] = values.to(self.weight)
        for p in self.optimizer.state_parts:  # the state of a row never updated
            getattr(self, p.name)[at] = p.initial
