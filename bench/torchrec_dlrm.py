"""TorchRec's DLRM under ``DistributedModelParallel``: the peer that ``bench/dist_throughput.py`` times.

Only importable where TorchRec and FBGEMM are installed (``make bench-dist`` builds ``.venv-bench`` with
torchrec==1.8.0 and fbgemm-gpu-cpu==1.8.0); the package itself never imports this module. ``available()``
says whether it can run here and why not.

The model is ``torchrec.models.dlrm.DLRM`` with the same architecture and tables as recstack's
(``DenseArch`` = bottom MLP with ReLU after every layer, ``InteractionArch`` = pairwise dots without self
products concatenated to the dense output, ``OverArch`` = top MLP ending in a logit). Embedding tables are
sharded by TorchRec's planner, restricted to one sharding type (``table_wise`` by default), with the fused
FBGEMM kernel updating rows inside backward (SGD, ``apply_optimizer_in_backward``); the dense part is
data-parallel (DMP's default DDP wrapper) with ``torch.optim.SGD``. Inputs arrive as recstack ``Batch``es
and are turned into a ``KeyedJaggedTensor`` without copying (both are feature-major jagged layouts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recstack.data.batch import Batch


def available() -> tuple[bool, str]:
    """-> (True, version) when TorchRec's sharded training path imports, else (False, the reason)."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec
        from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
    except Exception as e:  # ImportError, or a library that fails to load against this torch
        return False, f"{type(e).__name__}: {e}"
    return True, getattr(torchrec, "__version__", "unknown")


class TorchRecDLRM:
    """One rank's share of a sharded TorchRec DLRM. ``step(batch)`` trains on this rank's batch [B] and
    returns the loss; every rank must call it the same number of times (it runs collectives)."""

    def __init__(
        self,
        table_sizes: list[int],
        feature_names: list[str],
        dim: int,
        num_dense: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        batch_size: int,
        lr: float = 0.1,
        sharding: str = "table_wise",
        qcomms: str = "fp32",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """table_sizes[f]: rows of feature f's table (one table per feature); batch_size: per rank.
        ``qcomms``: precision of both pooled all-to-alls (fp32, fp16 or bf16; TorchRec's quantized comms)."""
        from torchrec import EmbeddingBagCollection
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.distributed.types import ShardingEnv
        from torchrec.models.dlrm import DLRM
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.keyed import KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        group = group or dist.group.WORLD
        world = dist.get_world_size(group)
        self.keys = list(feature_names)
        self.device = torch.device("cpu")
        tables = [
            EmbeddingBagConfig(name=f"table_{name}", embedding_dim=dim, num_embeddings=rows, feature_names=[name])
            for name, rows in zip(feature_names, table_sizes, strict=True)
        ]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))  # DMP materialises the shards
        model = DLRM(ebc, num_dense, bottom_mlp, top_mlp, dense_device=self.device)
        apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": lr})
        sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=_qcomms_registry(qcomms))
        constraints = {t.name: ParameterConstraints(sharding_types=[sharding]) for t in tables}
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu", local_world_size=world),
            constraints=constraints, batch_size=batch_size,
        )
        plan = planner.collective_plan(model, [sharder], group)
        self.model = DistributedModelParallel(
            model, env=ShardingEnv.from_process_group(group), device=self.device, plan=plan, sharders=[sharder],
        )
        self.plan = plan
        dense = dict(in_backward_optimizer_filter(self.model.named_parameters()))
        self.optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=lr))

    def kjt(self, batch: Batch) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        s = batch.sparse
        return KeyedJaggedTensor(keys=self.keys, values=s.ids, lengths=s.lengths, offsets=s.offsets)

    def step(self, batch: Batch) -> float:
        logits = self.model(batch.dense, self.kjt(batch)).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        self.optimizer.zero_grad()
        loss.backward()  # the fused kernel updates the embedding rows here
        self.optimizer.step()
        return loss.item()

    def pipelined(self, batches: Iterator[Batch]) -> Iterator[float]:
        """TorchRec's own ``TrainPipelineSparseDist`` over ``batches`` (the next batches' input distribution
        overlaps the current step): yields one loss per step. Raises where the pipeline does not run here."""
        from torchrec.datasets.utils import Batch as TRBatch
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        class _Train(torch.nn.Module):  # TorchRec's pipeline wants forward(batch) -> (loss, outputs)
            def __init__(self, dmp: torch.nn.Module) -> None:
                super().__init__()
                self.dmp = dmp

            def forward(self, b: TRBatch) -> tuple[torch.Tensor, torch.Tensor]:
                logits = self.dmp(b.dense_features, b.sparse_features).squeeze(-1)
                loss = F.binary_cross_entropy_with_logits(logits, b.labels)
                return loss, loss.detach()

        if not hasattr(self, "_pipeline"):
            self._train_module = _Train(self.model)
            self._pipeline = TrainPipelineSparseDist(self._train_module, self.optimizer, self.device)
        source = (TRBatch(b.dense, self.kjt(b), b.labels) for b in batches)
        while True:
            try:
                out = self._pipeline.progress(source)  # the second item of forward's result: the loss
            except StopIteration:
                return
            yield float(out)


def _qcomms_registry(qcomms: str) -> dict[str, Any] | None:
    """TorchRec's quantized-comms codecs for both directions of the pooled all-to-all, or None for fp32."""
    if qcomms == "fp32":
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    kind = {"fp16": CommType.FP16, "bf16": CommType.BF16}.get(qcomms)
    if kind is None:
        raise ValueError(f"TorchRec qcomms {qcomms!r}: only fp32, fp16 and bf16 are set up here")
    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=kind, backward_precision=kind))
