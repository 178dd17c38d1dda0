"""One user + 100 candidates in process: what reading the shared fields once and running the bottom MLP once
for them save, against the same requests taken as whole rows, in the same process, interleaved.

Model and requests as ``bench/serving_http.py`` (the Criteo Kaggle reference DLRM, 26 hashed tables of
``--max-ind-range`` rows; ``body``: ``shared`` = I1..I13 + C1..C13, 100 candidates of C14..C26), raw and encoded.
Arms, each the median of ``--reps`` interleaved repetitions over 20 different requests:

* ``encode_rows``: the candidates merged with the shared fields into 100 whole rows, ``ServingModel.encode``
  (what ``encode_candidates`` did before); ``encode_rows_python``: the same with the categoricals parsed by
  Python's ``int`` one value at a time (the encoder's parse before ``columns.hex_values``), raw only;
  ``encode_shared``: ``ServingModel.encode_candidates`` (shared fields read once, dense features one row);
* ``score_rows``: the model call with the user's dense features repeated for every row (R = B);
  ``score_shared``: with them once (R = 1, ``dense_row``);
* ``request_rows`` / ``request_shared``: decode the body + encode + score + the JSON answer (all but HTTP);
* ``one_row_call`` (compiled only): ``ServingModel.score`` of one row, the compiled program called through
  ``compile.direct_call`` against AOTInductor's own wrapper (5x the repetitions).

The scores of both paths are checked equal (within 1e-5 in the logits). With ``--compile-cache`` the dense
program is AOTInductor-compiled as ``recstack serve`` does (cached there; the first run compiles for minutes).

    python bench/serving_candidates.py --out bench/results/serving_candidates.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.serving_http import body, build  # noqa: E402
from recstack.serving.model import EncodedBatch, ServingModel  # noqa: E402
from recstack.serving.requests import encode_json, parse_request  # noqa: E402

FORMS = ("raw", "encoded")


def rows_batch(model: ServingModel, shared: dict, cands: list[dict], ids: bool) -> EncodedBatch:
    return model.encode([{**shared, **c} for c in cands], ids)


def python_parse_batch(model: ServingModel, shared: dict, cands: list[dict]) -> EncodedBatch:
    rows = [{**shared, **c} for c in cands]
    t = model.transforms
    t._check_keys(rows, t.raw_fields, "raw fields", False)
    return model._batch(*t._criteo_bags(*t._criteo_each(rows)))


def answer(model: ServingModel, raw: bytes, encode: Callable[..., EncodedBatch]) -> bytes:
    req = parse_request(raw, 2048)
    logits = model.score(encode(req)).numpy()
    return encode_json({"scores": (1 / (1 + np.exp(-logits))).tolist(), "model_version": model.version})


def measure(model: ServingModel, rows: list[dict], form: str, reps: int) -> dict[str, float]:
    ids = form == "encoded"
    bodies = [body(rows, form, 100, seed) for seed in range(20)]
    reqs = [parse_request(b, 2048) for b in bodies]
    shared_b = [model.encode_candidates(r.shared, r.rows, ids) for r in reqs]
    rows_b = [rows_batch(model, r.shared, r.rows, ids) for r in reqs]
    worst = max(float((model.score(a) - model.score(b)).abs().max()) for a, b in zip(shared_b, rows_b, strict=True))
    if worst > 1e-5:
        raise SystemExit(f"{form}: the shared path's logits differ from the rows' by {worst}")
    arms: dict[str, Callable[[int], Any]] = {
        "encode_rows": lambda i: rows_batch(model, reqs[i].shared, reqs[i].rows, ids),
        "encode_shared": lambda i: model.encode_candidates(reqs[i].shared, reqs[i].rows, ids),
        "score_rows": lambda i: model.score(rows_b[i]),
        "score_shared": lambda i: model.score(shared_b[i]),
        "request_rows": lambda i: answer(model, bodies[i], lambda r: rows_batch(model, r.shared, r.rows, ids)),
        "request_shared": lambda i: answer(model, bodies[i], lambda r: model.encode_candidates(r.shared, r.rows, ids)),
    }
    if not ids:
        arms["encode_rows_python"] = lambda i: python_parse_batch(model, reqs[i].shared, reqs[i].rows)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(reps):
        order = list(arms.items())
        random.shuffle(order)
        for name, call in order:
            start = time.perf_counter()
            call(i % len(reqs))
            times[name].append(time.perf_counter() - start)
    out = {f"{k}_ms": round(statistics.median(v) * 1e3, 4) for k, v in times.items()}
    out["request_speedup"] = round(out["request_rows_ms"] / out["request_shared_ms"], 3)
    out["max_logit_diff"] = worst
    return out


def one_row_call(direct: ServingModel, wrapped: ServingModel, rows: list[dict], form: str,
                 reps: int) -> dict[str, float]:
    """A one-row model call of the compiled program through ``compile.direct_call`` and through AOTInductor's
    wrapper (its tree specs parsed on every call), interleaved over 20 rows."""
    batches = [direct.encode(rows[i:i + 1], form == "encoded") for i in range(20)]
    for b in batches:
        if not torch.equal(direct.score(b), wrapped.score(b)):
            raise SystemExit("the direct call's logits differ from the wrapper's")
    arms = {"wrapper": wrapped.score, "direct": direct.score}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(reps):
        for name, call in random.sample(list(arms.items()), len(arms)):
            start = time.perf_counter()
            call(batches[i % len(batches)])
            times[name].append(time.perf_counter() - start)
    return {f"score_{k}_ms": round(statistics.median(v) * 1e3, 4) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-ind-range", type=int, default=200_000)
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--compile-cache", type=Path, default=None, help="AOTInductor-compile the dense program")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)  # as recstack serve's default
    with tempfile.TemporaryDirectory() as tmp:
        built = build(Path(tmp), a.max_ind_range)
        model = ServingModel.load(built["model"])
        if a.compile_cache is not None:
            from recstack.serving.compile import ensure_package, load_checked

            package = asyncio.run(ensure_package(model.program_path, model.device, a.compile_cache))
            model.use_compiled(load_checked(package, model))
            wrapped = ServingModel.load(built["model"])  # the same package through AOTInductor's wrapper
            wrapped.use_compiled(torch._inductor.aoti_load_package(str(package)))
        with torch.inference_mode():
            result: dict[str, Any] = {"compiled": model.compiled, "reps": a.reps,
                                      **{form: measure(model, built[form], form, a.reps) for form in FORMS}}
            if a.compile_cache is not None:
                result["one_row_call"] = {form: one_row_call(model, wrapped, built[form], form, a.reps * 5)
                                          for form in FORMS}
    text = json.dumps(result, indent=2)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
