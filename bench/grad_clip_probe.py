"""``recstack train`` with FuxiCTR's gradient-norm clipping emulated: what clipping does to a model whose data has
categorical fields only (MovieLens), before recstack has the option (README, "DCNv2 is behind").

FuxiCTR clips the norm of every parameter's gradient, its embedding tables' included, at ``max_gradient_norm``
(10; ``fuxictr/pytorch/models/rank_model.py``, ``train_step``: ``nn.utils.clip_grad_norm_(self.parameters(),
...)``) before its Adam step. recstack updates the tables inside backward, so the probe scales the gradient where
they receive it: a hook on the pooled embeddings [B, F, D] (the last gradient backward computes when there is no
bottom MLP) takes the norm of the dense gradients (already accumulated), of the per-row embedding gradients and of
the all-rows L2 term (lambda E, ``--l2``), and scales the pooled gradient (so every row's) and, before the dense
Adam step, every dense gradient by min(1, max_norm / norm). An experiment, not a training option: one process,
``FusedEmbeddingBagCollection`` tables, no dense features (it stops with an error otherwise). Prints JSON to stderr
at exit: the steps, how many were clipped and the first coefficients.

    python bench/grad_clip_probe.py [--max-norm 10] [--l2 0.01] -- train --config CONFIG --set ...
"""

from __future__ import annotations

import argparse
import atexit
import json
import runpy
import sys

import torch

from recstack.data.batch import Batch
from recstack.models import dlrm

STATE: dict = {"coef": 1.0, "coefs": [], "max_norm": 10.0, "l2": 0.0}


def _clipped_features(self: dlrm.DLRM, batch: Batch) -> torch.Tensor:
    """DLRM.forward_features for data without dense features, with the clipping hook on the pooled [B, F, D]."""
    if self.num_dense or self.projection is not None or self.qr is not None:
        raise SystemExit("grad_clip_probe: categorical fields only, plain tables (no dense, qr or table_dims)")
    sp = batch.sparse
    emb = self.embeddings(sp)  # [B, F, D]
    b, f, d = emb.shape
    if emb.requires_grad:
        table = self.embeddings.feature_table

        def hook(g: torch.Tensor) -> torch.Tensor:
            # one id per bag (MovieLens): feature-major ids; a row's gradient sums its bags' (table, row) keys
            keys = torch.cat([sp.ids[sp.offsets[k * b]:sp.offsets[(k + 1) * b]] + (int(table[k]) << 32)
                              for k in range(f)])
            _, inv = torch.unique(keys, return_inverse=True)
            rows = torch.zeros(int(inv.max()) + 1, d).index_add_(0, inv, g.transpose(0, 1).reshape(f * b, d))
            dense = [p.grad for n, p in self.named_parameters() if not n.startswith("embeddings.")]
            sq = sum(float(x.pow(2).sum()) for x in dense if x is not None) + float(rows.pow(2).sum())
            sq += sum(float((STATE["l2"] * v.float()).pow(2).sum()) for k, v in self.embeddings.state_dict().items()
                      if k.endswith("weight"))
            STATE["coef"] = min(1.0, STATE["max_norm"] / (sq**0.5 + 1e-6))
            STATE["coefs"].append(STATE["coef"])
            return g * STATE["coef"]

        emb.register_hook(hook)
    return self.interaction(None, emb)


_adam_step = torch.optim.Adam.step


def _clipped_step(self: torch.optim.Adam, *args, **kwargs):  # type: ignore[no-untyped-def]
    """The dense Adam step on gradients scaled by this step's coefficient."""
    if STATE["coef"] < 1.0:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(STATE["coef"])
    STATE["coef"] = 1.0
    return _adam_step(self, *args, **kwargs)


def _report() -> None:
    c = STATE["coefs"]
    out = {"steps": len(c), "clipped": sum(x < 1.0 for x in c), "first_coefs": [round(x, 4) for x in c[:5]]}
    print(json.dumps(out), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-norm", type=float, default=10.0, help="FuxiCTR's max_gradient_norm")
    ap.add_argument("--l2", type=float, default=0.01, help="optim.sparse_weight_decay of an all_rows config")
    ap.add_argument("recstack_args", nargs=argparse.REMAINDER, help="-- then recstack's arguments")
    args = ap.parse_args()
    STATE.update(max_norm=args.max_norm, l2=args.l2)
    dlrm.DLRM.forward_features = _clipped_features  # type: ignore[method-assign]
    torch.optim.Adam.step = _clipped_step  # type: ignore[method-assign]
    atexit.register(_report)
    rest = args.recstack_args
    sys.argv = ["recstack", *(rest[1:] if rest[:1] == ["--"] else rest)]
    runpy.run_module("recstack", run_name="__main__")


if __name__ == "__main__":
    main()
