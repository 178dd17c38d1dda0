"""Where tensors live on the GPU paths, checked on a CPU machine: "meta" stands in for a CUDA device (a tensor
there that meets a CPU one fails the same way), and a stand-in object for a tensor that only ``.cpu()`` can read;
how a rank joins a job on CUDA (NCCL, its timeout and watchdog setting), with stand-ins for CUDA and NCCL. The
tests that need a real GPU are skipped without one."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import free_port

from recstack.data.batch import SparseFeatures
from recstack.embedding import FusedEmbeddingBagCollection, SparseOptimizerConfig, TableConfig
from recstack.training.checkpoint.state import rng_state, set_rng_state

TABLES = [TableConfig("a", 6, 4, (0,)), TableConfig("b", 3, 4, (1,)), TableConfig("c", 5, 4, (2,))]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_fused_collection_keeps_every_buffer_on_its_device() -> None:
    """A collection built for a device is used there as built, without a later ``.to`` (the sharded collection
    builds its local tables after the model was moved), so its row offsets must be there too: a CPU
    ``feature_offsets`` fails against the ids of a CUDA batch."""
    coll = FusedEmbeddingBagCollection(TABLES, SparseOptimizerConfig("rowwise_adagrad"), device="meta")
    assert {name: b.device.type for name, b in coll.named_buffers()} == {
        "table_offsets": "meta", "feature_offsets": "meta", "weight": "meta", "accumulator": "meta"}
    sparse = SparseFeatures.from_dense_ids(torch.tensor([[1, 2, 0], [5, 0, 4]])).to("meta")
    coll.eval()
    with torch.no_grad():
        out = coll(sparse)
    assert out.device.type == "meta" and tuple(out.shape) == (2, 3, 4)


def test_sharded_collection_tables_are_on_its_device(tmp_path: Path) -> None:
    """The sharded collection's local and replicated tables (built inside it, never moved) hold every buffer on
    the collection's device."""
    from recstack.distributed.sharded_collection import ShardedEmbeddingCollection

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        coll = ShardedEmbeddingCollection(TABLES, SparseOptimizerConfig("rowwise_adagrad"),
                                          [("table_wise", [0]), ("row_wise", [0]), ("data_parallel", [0])],
                                          device="meta")
        devices = {name: b.device.type for name, b in coll.named_buffers()}
    finally:
        dist.destroy_process_group()
    assert any(name.startswith("groups.") for name in devices) and any(n.startswith("replicated.") for n in devices)
    assert set(devices.values()) == {"meta"}, devices


@pytest.mark.parametrize("preset", [None, "1"], ids=["unset", "set-by-the-user"])
def test_init_on_cuda_takes_nccl_with_the_timeout_on_every_group(monkeypatch: pytest.MonkeyPatch,
                                                                 preset: str | None) -> None:
    """Under torchrun with CUDA, ``init_distributed`` starts NCCL with ``dist.timeout_s`` as the group's timeout,
    sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (NCCL's watchdog tears down a rank whose collective timed out) when
    the user has not, and the embedding collection's process groups (all-to-alls, input distribution) get the
    same timeout.

    A unit test: this machine has no GPU, so ``torch.cuda.is_available`` and ``set_device`` are stand-ins, and
    ``init_process_group`` records what it was asked for, then starts a real one-rank gloo group in its place
    (NCCL cannot start without a GPU) so that the code after it runs as under torchrun. The same timeout is
    tested end to end on gloo (``test_rank_faults.py``)."""
    import datetime

    from recstack.config import load_config
    from recstack.distributed import parallelize

    cfg = load_config(None, ["dist.timeout_s=17"]).dist
    asked: list[tuple[str | None, dict]] = []
    devices: list[torch.device] = []
    real_init, real_new_group = dist.init_process_group, dist.new_group
    new_groups: list[dict] = []

    def init_process_group(backend: str | None = None, **kwargs: object) -> None:
        asked.append((backend, kwargs))
        real_init("gloo", **kwargs)

    def new_group(*args: object, **kwargs: object) -> object:
        new_groups.append(kwargs)
        return real_new_group(*args, **kwargs)

    port = free_port()
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "TORCH_NCCL_ASYNC_ERROR_HANDLING": preset or "-"}.items():
        monkeypatch.setenv(name, value)  # (each one restored afterwards, also the one init sets)
    if preset is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    for name in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "new_group", new_group)
    try:
        assert parallelize.init_distributed(cfg) == (0, 1, torch.device("cuda", 0))
        from recstack.distributed.sharded_collection import ShardedEmbeddingCollection

        ShardedEmbeddingCollection(TABLES, SparseOptimizerConfig("rowwise_adagrad"),
                                   [("table_wise", [0]), ("row_wise", [0]), ("data_parallel", [0])], device="meta",
                                   timeout_s=cfg.timeout_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    timeout = datetime.timedelta(seconds=17)
    assert [backend for backend, _ in asked] == ["nccl"] and asked[0][1]["timeout"] == timeout
    assert devices == [torch.device("cuda", 0)]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == (preset or "3")
    # ids, pooled outputs, replicated tables
    assert len(new_groups) == 3 and all(g.get("timeout") == timeout for g in new_groups), new_groups


class _OnDevice:
    """Stands for a tensor that ``torch.load(map_location="cuda")`` put on a GPU: numpy cannot read it and the
    generators refuse it; ``.cpu()`` gives the values."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def cpu(self) -> torch.Tensor:
        return self._t.clone()


def _draws() -> tuple[float, float]:
    return float(np.random.rand()), float(torch.rand(()))


def test_rng_state_restores_from_device_tensors() -> None:
    """A resume loads its checkpoint onto the training device, RNG state included (``rng_state``'s tensors)."""
    state = rng_state()
    want = _draws()
    state["numpy"][1] = _OnDevice(state["numpy"][1])
    state["torch"] = _OnDevice(state["torch"])
    state.pop("cuda_device", None)
    set_rng_state(state)
    assert _draws() == want


@pytest.mark.parametrize("here,saved,want", [(0, "cuda_device", "own"), (1, 8, 1), (3, 2, None)])
def test_rng_state_resumes_on_its_own_device_with_fewer_gpus(monkeypatch: pytest.MonkeyPatch, here: int,
                                                             saved: str | int, want: str | int | None) -> None:
    """A rank restores the CUDA generator of its own device only: from this version's one state, or from an
    older checkpoint's state of every device the saving run saw, also when this run sees fewer (stand-ins
    for CUDA: the calls are recorded)."""
    state = {k: v for k, v in rng_state().items() if not k.startswith("cuda")}
    restored: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: here)
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every device's state set"))
    if saved == "cuda_device":
        state["cuda_device"] = torch.full((4,), 7, dtype=torch.uint8)
    else:
        state["cuda"] = [torch.full((4,), i, dtype=torch.uint8) for i in range(int(saved))]
    set_rng_state(state)
    if want is None:
        assert restored == []  # the saving run had no state for this device: the generator stays as seeded
    else:
        assert len(restored) == 1 and int(restored[0][0]) == (7 if want == "own" else want)


@needs_cuda
def test_rng_state_restores_from_a_checkpoint_loaded_onto_the_gpu() -> None:
    buf = io.BytesIO()
    torch.save({"rng": rng_state()}, buf)
    want = (*_draws(), float(torch.rand((), device="cuda")))
    buf.seek(0)
    state = torch.load(buf, map_location=torch.device("cuda", torch.cuda.current_device()), weights_only=True)
    assert state["rng"]["torch"].is_cuda  # what a resume on the GPU gets
    set_rng_state(state["rng"])
    assert (*_draws(), float(torch.rand((), device="cuda"))) == want


def _recording_pipeline(tmp_path: Path, device: torch.device):  # type: ignore[no-untyped-def]
    """An InputPipeline over a one-rank sharded collection whose ``prepare_input`` records where it was called
    (the device of the ids, the thread's current CUDA device, the thread) and whose ``exchange_input`` records
    its thread, and a list of the batches split."""
    import threading

    from recstack.distributed.input_dist import PreparedInput, RoutedIds
    from recstack.distributed.pipeline import InputPipeline
    from recstack.distributed.sharded_collection import ShardedEmbeddingCollection

    class Recording(ShardedEmbeddingCollection):
        seen: list[tuple[str, int | None]] = []
        threads: list[tuple[str, str]] = []

        def prepare_input(self, sparse: SparseFeatures) -> PreparedInput:
            current = torch.cuda.current_device() if torch.cuda.is_available() else None
            self.seen.append((str(sparse.ids.device), current))
            self.threads.append(("prepare", threading.current_thread().name))
            return PreparedInput(sparse.ids, [], None, [])

        def exchange_input(self, prep: PreparedInput) -> RoutedIds:
            self.threads.append(("exchange", threading.current_thread().name))
            return RoutedIds(prep.ids, [1], [], [], None)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    emb = Recording(TABLES[:2], SparseOptimizerConfig("sgd"), [("table_wise", [0])] * 2, device="meta")
    split: list = []
    model = SimpleNamespace(embeddings=emb, qr=None, split_batch=lambda b: split.append(b) or b)
    return InputPipeline(model, device, pipelined=True), emb, split  # type: ignore[arg-type]


def _in_thread(fn, *args):  # type: ignore[no-untyped-def]
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def _batch():  # type: ignore[no-untyped-def]
    from recstack.data.batch import Batch

    return Batch(torch.zeros(2, 1), SparseFeatures.from_dense_ids(torch.tensor([[1, 2], [0, 1]])), torch.zeros(2))


def test_pipelined_input_prepares_in_the_loader_thread_and_exchanges_in_the_training_thread(
    tmp_path: Path,
) -> None:
    """The loader thread splits the batch, moves it to the device and builds its messages there, with no
    collective; the training thread runs the exchange of each batch a batch ahead and hands its routed ids to the
    collection as it yields it, once, with the loader's position just after it."""
    pipe, emb, split = _recording_pipeline(tmp_path, torch.device("meta"))
    try:
        first, second = (_in_thread(pipe.train_transform, _batch()) for _ in range(2))
        assert [b.sparse.ids.device.type for b in split] == ["cpu", "cpu"]  # split on the host ids
        assert first.sparse.ids.device.type == "meta" and [d for d, _ in emb.seen] == ["meta", "meta"]
        loader = SimpleNamespace(position=0)  # the loader's position: batches read so far

        def read(batches):  # type: ignore[no-untyped-def]
            for i, b in enumerate(batches):
                loader.position = i + 1
                yield b

        it = pipe.batches(read([first, second]), loader)  # type: ignore[arg-type]
        # the second batch was read ahead, but a checkpoint after the first's step resumes with the second
        assert next(it) is first and loader.position == 1
        # both exchanged (the second a batch ahead) by this thread before the first was yielded
        assert [t for t in emb.threads if t[0] == "exchange"] == [("exchange", "MainThread")] * 2
        assert all(name != "MainThread" for kind, name in emb.threads if kind == "prepare")
        assert emb._routed is not None and emb._routed.ids is first.sparse.ids
        emb._routed = None  # what the first batch's forward does
        assert next(it) is second and emb._routed.ids is second.sparse.ids and loader.position == 2
        emb._routed = None
        with pytest.raises(RuntimeError, match="did not stage"):  # a batch the loader's thread did not stage
            list(pipe.batches([_batch()]))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_pipelined_input_runs_on_the_ranks_gpu_in_the_loader_thread(tmp_path: Path) -> None:
    """Rank 1's loader thread works on cuda:1, not on the thread default cuda:0."""
    pipe, emb, _ = _recording_pipeline(tmp_path, torch.device("cuda", 1))
    try:
        _in_thread(pipe.train_transform, _batch())
        assert emb.seen == [("cuda:1", 1)]
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tiered_prefetch_thread_runs_on_the_collections_gpu() -> None:
    from recstack.embedding.tiered.collection import TieredEmbeddingCollection
    from recstack.embedding.tiered.placement import TablePlacement

    cached = TablePlacement("host-cached", 2)
    tc = TieredEmbeddingCollection(TABLES, SparseOptimizerConfig("sgd", 0.1), [cached, cached, TablePlacement()],
                                   device="cuda:1")
    hook = tc.next_batch_hook()
    first, second = (SparseFeatures.from_dense_ids(torch.tensor(ids)) for ids in ([[1, 2, 0]], [[5, 1, 4]]))
    for s in (first, second):
        hook(SimpleNamespace(sparse=s))  # what the loader hands it: a batch
    tc(first.to("cuda:1")).sum().backward()  # prefetches ``second`` in the collection's thread
    try:
        assert tc._pool is not None and tc._pool.submit(torch.cuda.current_device).result() == 1
    finally:
        tc.close()


@pytest.mark.parametrize("gpus,local_world,name,asked,want", [
    (0, 2, "auto", "auto", ("cpu", "gloo")),
    (2, 2, "auto", "auto", ("cuda:1", "nccl")),  # a GPU per rank
    (1, 2, "auto", "auto", ("cuda:0", "gloo")),  # two ranks share the GPU: NCCL would refuse
    (1, 2, "cuda", "gloo", ("cuda:0", "gloo")),
    (2, 2, "cuda:0", "auto", ("cuda:0", "gloo")),  # every rank on cuda:0
    (2, 2, "cpu", "auto", ("cpu", "gloo")),
    (1, 2, "auto", "nccl", 'dist.backend = "nccl": the 2 ranks of this node share 1 GPU'),
    (0, 2, "auto", "nccl", 'dist.backend = "nccl": needs a CUDA device'),
])
def test_dist_backend_and_the_ranks_device(monkeypatch: pytest.MonkeyPatch, gpus: int, local_world: int,
                                           name: str, asked: str, want: tuple[str, str] | str) -> None:
    """``dist.backend`` and ``train.device`` under torchrun, rank 1 of a node of ``local_world`` ranks and
    ``gpus`` GPUs (stand-ins: the device count is all the choice reads)."""
    from recstack.distributed.parallelize import choose_backend, rank_device
    from recstack.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    device = rank_device(name, local_rank=1)
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want.replace("(", r"\(")):
            choose_backend(asked, device, name, local_world)
        return
    assert (str(device), choose_backend(asked, device, name, local_world)) == want
