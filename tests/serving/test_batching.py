"""Adaptive batching (``recstack.serving.batching``) on a real exported model: a request that
arrives alone is scored at once in the event loop's thread, whatever ``max_wait_us`` says; requests
that arrive while the model is busy share its next call and each gets exactly its own scores."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch
from server_helpers import raw_criteo_rows, request_rows, shared_artifacts  # noqa: F401 (a fixture)

from recstack.serving.batching import Batcher
from recstack.serving.metrics import ServerMetrics
from recstack.serving.model import ServingModel

ROWS = request_rows(raw_criteo_rows(16, seed=5))


def offline(model: ServingModel, rows: list[dict]) -> np.ndarray:
    with torch.inference_mode():
        return torch.sigmoid(model.score(model.encode(rows))).numpy()


def test_a_lone_request_is_scored_at_once_in_the_loop_thread(shared_artifacts) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    metrics = ServerMetrics()
    # An hour's batching window: a batcher that waited for company would not answer in time.
    batcher = Batcher(max_batch=64, max_wait_us=3600 * 10**6, metrics=metrics)

    async def lone() -> list[np.ndarray]:
        out = []
        for i in range(3):
            batch = model.encode(ROWS[i : i + 2])
            logits, prob = await asyncio.wait_for(batcher.score(model, batch, 2), 60)
            out.append(prob)
        await batcher.stop()
        return out

    probs = asyncio.run(lone())
    for i, p in enumerate(probs):
        np.testing.assert_allclose(p, offline(model, ROWS[i : i + 2]), rtol=0, atol=1e-6)
    # No model thread was ever started: a lone request costs no thread hand-off.
    assert not [t for t in threading.enumerate() if t.name.startswith("recstack-model")]
    samples = {s.name: s.value for s in metrics.batch_requests.collect()[0].samples}
    assert samples["recstack_batch_requests_sum"] == samples["recstack_batch_requests_count"] == 3


def test_requests_arriving_while_the_model_is_busy_share_a_call(shared_artifacts) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    metrics = ServerMetrics()
    batcher = Batcher(max_batch=64, max_wait_us=0, metrics=metrics)

    async def burst() -> list[np.ndarray]:
        async def one(i: int) -> np.ndarray:
            with batcher.arriving():  # as the server does while it reads and encodes a request
                await asyncio.sleep(0)
                batch = model.encode(ROWS[i : i + 1 + i % 3])
            return (await batcher.score(model, batch, batch.size))[1]

        out = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(12))), 60)
        await batcher.stop()
        return list(out)

    probs = asyncio.run(burst())
    for i, p in enumerate(probs):
        np.testing.assert_allclose(p, offline(model, ROWS[i : i + 1 + i % 3]), rtol=0, atol=1e-6)
    samples = {s.name: s.value for s in metrics.batch_requests.collect()[0].samples}
    assert samples["recstack_batch_requests_sum"] == 12
    assert samples["recstack_batch_requests_count"] < 12  # fewer model calls than requests


def test_the_vectorised_id_encoder_equals_the_value_by_value_one(shared_artifacts) -> None:  # noqa: F811
    model = ServingModel.load(shared_artifacts["models"] / "1")
    t = model.transforms
    b = model.encode(ROWS)
    ids = b.sparse.ids.view(len(model.feature_names), len(ROWS))
    dense_names = model.manifest["model"]["dense_features"]
    rows = [
        {
            **{n: float(b.dense[i, j]) for j, n in enumerate(dense_names)},
            **{n: int(ids[f, i]) for f, n in enumerate(model.feature_names)},
        }
        for i in range(len(ROWS))
    ]
    rows[3]["I2"] = 7  # an integer for a dense value
    fast = t._ids_by_column(rows)
    assert fast is not None
    slow = t.encode_ids_each(rows)
    np.testing.assert_array_equal(fast[0], slow[0])
    for (fl, fi, _), (sl, si, _) in zip(fast[1], slow[1], strict=True):
        np.testing.assert_array_equal(fl, sl)
        np.testing.assert_array_equal(fi, si)
    for bad in ({"C1": -1}, {"C2": 10**30}, {"I1": 1e300}, {"I3": True}, {"C4": 1.0}):
        assert (
            t._ids_by_column([rows[0], {**rows[1], **bad}]) is None
        )  # left to the value-by-value checks


def test_requests_that_arrive_in_one_turn_of_the_loop_share_a_call(shared_artifacts) -> None:  # noqa: F811
    """Under load the server's loop reads many connections in one turn, and their handlers run to the
    batcher one after the other without waiting for anything: each must not look alone."""
    model = ServingModel.load(shared_artifacts["models"] / "1")
    metrics = ServerMetrics()
    batcher = Batcher(max_batch=64, max_wait_us=0, metrics=metrics)

    async def burst() -> list[np.ndarray]:
        async def one(i: int) -> np.ndarray:  # its body already received: nothing to wait for
            batch = model.encode(ROWS[i : i + 1])
            return (await batcher.score(model, batch, batch.size))[1]

        out = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(8))), 60)
        await batcher.stop()
        return list(out)

    probs = asyncio.run(burst())
    for i, p in enumerate(probs):
        np.testing.assert_allclose(p, offline(model, ROWS[i : i + 1]), rtol=0, atol=1e-6)
    samples = {s.name: s.value for s in metrics.batch_requests.collect()[0].samples}
    assert samples["recstack_batch_requests_sum"] == 8
    assert samples["recstack_batch_requests_count"] == 1  # all eight in one model call


def test_one_id_a_bag_gathers_what_the_bags_sum(shared_artifacts) -> None:  # noqa: F811
    """The collection's path for batches of one id a bag (rows gathered, no bags summed) gives the pooled
    embeddings of the general path, bit for bit."""
    model = ServingModel.load(shared_artifacts["models"] / "1")
    batch = model.encode(ROWS)
    assert batch.one_id_per_bag
    with torch.inference_mode():
        fast = model.collection(batch.sparse, one_id_per_bag=True)
        general = model.collection(batch.sparse, one_id_per_bag=False)
    assert fast.shape == (len(ROWS), len(model.feature_names), model.collection.embedding_dim)
    torch.testing.assert_close(fast, general, rtol=0, atol=0)
