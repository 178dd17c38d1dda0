"""The server a user would write in 60 lines, the baseline of ``bench/serving_http.py``: starlette +
the trained checkpoint through ``recstack.training.inference.load_model``, eager PyTorch per request
(no batching, no validation), raw Criteo rows (hashed categoricals, log1p dense) or encoded ids, as
``/v1/score`` takes them.

    python bench/eager_server.py RUN_DIR MAX_IND_RANGE PORT
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recstack.data.batch import Batch, SparseFeatures  # noqa: E402
from recstack.training.inference import load_model  # noqa: E402

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


def main() -> None:
    run, max_ind_range, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    _, model = load_model(run, "cpu")
    model.eval()

    async def score(request: Request) -> JSONResponse:
        req = json.loads(await request.body())
        rows = req["rows"] if "rows" in req else [{**req["shared"], **c} for c in req["candidates"]]
        if req.get("encoded"):
            dense = torch.tensor([[r[k] for k in DENSE] for r in rows], dtype=torch.float32)
            ids = torch.tensor([[r[k] for k in SPARSE] for r in rows], dtype=torch.int64)
        else:
            dense = torch.tensor(
                [[math.log1p(max(r[k] or 0, 0)) for k in DENSE] for r in rows], dtype=torch.float32
            )
            ids = torch.tensor(
                [[int(r[k], 16) % max_ind_range if r[k] else 0 for k in SPARSE] for r in rows]
            )
        with torch.inference_mode():
            logits = model(Batch(dense, SparseFeatures.from_dense_ids(ids), torch.zeros(len(rows))))
        return JSONResponse({"scores": torch.sigmoid(logits).tolist()})

    app = Starlette(routes=[Route("/v1/score", score, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
