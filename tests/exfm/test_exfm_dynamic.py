"""Vertical models with dynamic id tables (``[vm.model.dynamic_ids]``): raw ids remapped before every training
step, looked up without admission in progressive evaluation, the id maps in every window checkpoint (a VM killed
inside a window and resumed ends equal to an uninterrupted one) and handed from the warm-up to the arm; and the
config errors of dynamic ids and ``[experiment.publish_vm]``, each naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recstack.data.prepared_dataset import PreparedDataset
from recstack.data.synth.generate import SynthConfig, generate
from recstack.embedding.dynamic_stage import DynamicIds
from recstack.errors import ConfigError
from recstack.exfm.config import NetSpec, StreamConfig, exfm_config_from_dict
from recstack.exfm.experiment import ExperimentRunner
from recstack.exfm.vm_stream import VMJob, load_serving_head, run_vm_stream, vm_body
from recstack.exfm.windows import VerticalIndex, make_windows, row_batches
from recstack.metrics import BinaryMetrics
from recstack.training.checkpoint.single import latest_checkpoint


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = SynthConfig(rows=2400, num_days=5, num_verticals=2, table_sizes=(60, 40), num_dense=2, calibration_rows=512,
                      seed=3, raw_ids=True, id_churn=0.3)
    return generate(cfg, tmp_path_factory.mktemp("dyn") / "d", progress=False)


def _job(data: Path, out: Path, phase: str, warm: Path | None = None) -> VMJob:
    spec = NetSpec(batch_size=32)
    spec.model.embedding_dim, spec.model.bottom_mlp, spec.model.top_mlp = 4, [8, 4], [8, 1]
    o = spec.optim
    o.dense, o.dense_lr, o.sparse, o.sparse_lr = "adam", 0.01, "rowwise_adagrad", 0.1
    d = spec.model.dynamic_ids
    d.enabled, d.capacity, d.admit_after, d.eviction = True, 24, 2, "lru"  # fewer rows than ids: evictions
    return VMJob(data=str(data), out_dir=str(out), phase=phase, vertical=1, warm_dir=str(warm or ""), seed=0,
                 vm=spec, stream=StreamConfig(window=1, vm_start=2))


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "train_seconds"} for r in records]


def test_vm_dynamic_ids_hand_over_and_resume_exactly(data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    warm = tmp_path / "warm"
    run_vm_stream(_job(data, warm, "warmup"))
    warm_state = latest_checkpoint(warm / "checkpoints")
    assert set(warm_state["dynamic_ids"]) == {"C1", "C2"}  # the id maps are in the window checkpoint
    ref = run_vm_stream(_job(data, tmp_path / "ref", "arm", warm))
    last = ref["records"][-1]
    assert last["dynamic_ids/evictions"] > 0 and last["dynamic_ids/collisions"] == 0
    assert last["dynamic_ids/admissions"] > warm_state["dynamic_ids"]["C1"]["counters"]["admissions"]

    # hand-over: the arm's first progressive evaluation (before it trains) is the warm-up body with its maps
    ds = PreparedDataset(data)
    w = make_windows(ds, StreamConfig(window=1, vm_start=2))[2]
    rows = VerticalIndex(ds).rows(w, 1)
    job = _job(data, tmp_path / "x", "warmup")
    body = vm_body(job, ds)
    body.load_state_dict({k.removeprefix("body."): v for k, v in warm_state["model"].items()})

    def first_window_ne(dyn: DynamicIds) -> float:
        m = BinaryMetrics()
        with torch.no_grad():
            for batch in row_batches(ds, rows, 4096, caps=torch.zeros(2, dtype=torch.int64)):
                m.update(body.eval()(dyn.lookup_batch(batch)), batch.labels)
        return m.compute()["ne"]

    assert body.dynamic_ids is not None
    empty = first_window_ne(body.dynamic_ids)
    body.dynamic_ids.load_state_dict(warm_state)
    assert first_window_ne(body.dynamic_ids) == pytest.approx(ref["records"][0]["serving"]["ne"], abs=1e-9)
    assert empty != pytest.approx(ref["records"][0]["serving"]["ne"], abs=1e-6)  # without the maps: other scores

    # killed inside window 3 (after its first remapped steps), resumed: the uninterrupted VM, maps included
    calls = {"n": 0}
    real = DynamicIds.remap_batch

    def crashing(self: DynamicIds, batch):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 8 + sum(r["train_steps"] for r in ref["records"][:1]):
            raise KeyboardInterrupt("simulated kill")
        return real(self, batch)

    monkeypatch.setattr(DynamicIds, "remap_batch", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_vm_stream(_job(data, tmp_path / "cut", "arm", warm))
    monkeypatch.setattr(DynamicIds, "remap_batch", real)
    res = run_vm_stream(_job(data, tmp_path / "cut", "arm", warm))
    assert _strip(res["records"]) == _strip(ref["records"])
    a, b = latest_checkpoint(tmp_path / "ref" / "checkpoints"), latest_checkpoint(tmp_path / "cut" / "checkpoints")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for table, m in a["dynamic_ids"].items():
        for k, v in m.items():
            assert torch.equal(v, b["dynamic_ids"][table][k]) if isinstance(v, torch.Tensor) else v == \
                b["dynamic_ids"][table][k], (table, k)
    head = load_serving_head(tmp_path / "cut")  # the serving head as saved: body and maps of the final window
    assert head.dynamic_ids is not None
    assert torch.equal(head.dynamic_ids.maps["C1"].keys, a["dynamic_ids"]["C1"]["keys"])


BASE = {"data": {"synth": {"rows": 600, "num_days": 4, "num_verticals": 2, "table_sizes": [20, 10]}},
        "stream": {"vm_start": 2}, "experiment": {"arms": ["alone", "aux"], "staleness": [1], "seeds": [0]}}


def _cfg(**sections: dict) -> dict:
    out = {k: dict(v) for k, v in BASE.items()}
    for name, values in sections.items():
        out[name] = {**out.get(name, {}), **values}
    return out


@pytest.mark.parametrize(("sections", "message"), [
    ({"fm": {"model": {"dynamic_ids": {"enabled": True}}}}, "fm.model.dynamic_ids: the foundation model"),
    ({"vm": {"model": {"dynamic_ids": {"enabled": True, "capacity": 1}}}}, "vm.model.dynamic_ids.capacity"),
    ({"experiment": {**BASE["experiment"], "publish_vm": {"vertical": 0, "arm": "distill", "staleness": 1}}},
     "experiment.publish_vm.arm: 'distill' is not one of experiment.arms"),
    ({"experiment": {**BASE["experiment"], "publish_vm": {"vertical": 0, "arm": "aux", "staleness": 2}}},
     "experiment.publish_vm.staleness: 2 is not one of [1]"),
    ({"experiment": {**BASE["experiment"], "publish_vm": {"vertical": 0, "arm": "alone", "staleness": 1}}},
     "experiment.publish_vm.staleness: 1 is not one of [-1]"),
    ({"experiment": {**BASE["experiment"], "publish_vm": {"vertical": 0, "seed": 5}}},
     "experiment.publish_vm.seed: 5"),
    ({"experiment": {**BASE["experiment"], "publish_vm": {"vertical": 0, "every_s": -1.0}}},
     "experiment.publish_vm.every_s"),
    ({"experiment": {**BASE["experiment"], "publish_vm": {"vertical": 0, "tables": "int3"}}},
     "experiment.publish_vm.tables"),
    ({"experiment": {**BASE["experiment"], "publish_vm": {"vertical": 0, "arn": "aux"}}},
     "experiment.publish_vm: unknown key 'arn'"),
])
def test_config_errors_name_the_key(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        exfm_config_from_dict(_cfg(**sections))
    assert message in str(err.value)


def test_publishing_needs_a_publisher_and_a_vertical_of_the_data(tmp_path: Path) -> None:
    cfg = exfm_config_from_dict(_cfg(experiment={**BASE["experiment"], "publish_vm": {"vertical": 5}}))
    with pytest.raises(ConfigError, match="experiment.publish_vm: this runner was given no publisher"):
        ExperimentRunner(cfg, tmp_path)
    with pytest.raises(ConfigError, match=r"experiment.publish_vm.vertical: 5 is not a vertical of the data"):
        ExperimentRunner(cfg, tmp_path, log=lambda _: None, publisher=lambda *a: None).plan()  # type: ignore[arg-type,return-value]
