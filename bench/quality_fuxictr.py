"""The FuxiCTR half of ``bench/quality.py``: runs in FuxiCTR's own environment (``make bench-quality`` builds it;
recstack is not installed there and never depends on FuxiCTR).

FuxiCTR's wheel ships the library (feature processing, ``BaseModel`` with its training loop, early stopping and
best-model selection, the layers) but not its model zoo, where DLRM and DCNv2 live. ``DLRM`` and ``DCNv2`` here
assemble the wheel's layers as FuxiCTR's ``model_zoo/DLRM/src/DLRM.py`` and ``model_zoo/DCNv2/src/DCNv2.py`` do
(the variants the bench uses: DLRM with the ``dot`` or ``cat`` interaction, DCNv2 ``parallel`` without the
low-rank mixture).

One call encodes a prepared split directory once (``train.csv``, ``valid.csv``, ``test.csv`` and ``spec.json``
from ``bench/quality.py``: FuxiCTR's feature processor fits vocabularies on the training split, then writes one
``.npz`` per split) and trains one model for each seed, printing one JSON object per line:

    python bench/quality_fuxictr.py --data DIR --model DLRM --settings '{...}' --seeds 0 1 2 --work WORK
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
from fuxictr.features import FeatureMap
from fuxictr.preprocess import FeatureProcessor
from fuxictr.pytorch.dataloaders import RankDataLoader
from fuxictr.pytorch.layers import CrossNetV2, FeatureEmbedding, InnerProductInteraction, MLP_Block
from fuxictr.pytorch.models import BaseModel
from fuxictr.pytorch.torch_utils import seed_everything
from torch import nn

# Training-loop settings every FuxiCTR run here shares (its model_zoo ``Base`` section); the model settings come
# from bench/quality.py. num_workers 0: the loader runs in the training process (2 cores; no effect on results).
BASE = {"loss": "binary_crossentropy", "metrics": ["AUC", "logloss"], "task": "binary_classification",
        "optimizer": "adam", "verbose": 0, "num_workers": 0, "save_best_only": True, "eval_steps": None,
        "data_format": "npz"}


class _Model(BaseModel):
    """FuxiCTR's BaseModel fed from the npz loader, which stacks every column into one float64 array: numeric
    inputs go to the layers as float32 (categorical ids are cast to long by the embedding layer)."""

    def get_inputs(self, inputs, feature_source=None):
        X = super().get_inputs(inputs, feature_source)
        return {k: v.float() if self.feature_map.features[k]["type"] == "numeric" else v for k, v in X.items()}


class DLRM(_Model):
    """DLRM on FuxiCTR's layers: embeddings of the categorical fields, a bottom MLP for the numeric ones (its
    output is one more field), then pairwise dot products (``dot``) or the flat embeddings (``cat``) into the top
    MLP. Input: FuxiCTR's batch dict; output ``{"y_pred": (batch, 1)}`` probabilities."""

    def __init__(self, feature_map, model_id="DLRM", gpu=-1, learning_rate=1e-3, embedding_dim=10,
                 top_mlp_units=(64, 64, 64), bottom_mlp_units=(64, 64, 64), top_mlp_activations="ReLU",
                 bottom_mlp_activations="ReLU", top_mlp_dropout=0, bottom_mlp_dropout=0, interaction_op="dot",
                 batch_norm=False, embedding_regularizer=None, net_regularizer=None, **kwargs):
        super().__init__(feature_map, model_id=model_id, gpu=gpu, embedding_regularizer=embedding_regularizer,
                         net_regularizer=net_regularizer, **kwargs)
        self.dense_feats = [f for f, spec in feature_map.features.items() if spec["type"] == "numeric"]
        self.embedding_layer = FeatureEmbedding(feature_map, embedding_dim,
                                                not_required_feature_columns=self.dense_feats)
        n_fields = feature_map.num_fields - len(self.dense_feats) + (1 if self.dense_feats else 0)
        if self.dense_feats:
            self.bottom_mlp = MLP_Block(input_dim=len(self.dense_feats), output_dim=embedding_dim,
                                        hidden_units=list(bottom_mlp_units or []),
                                        hidden_activations=bottom_mlp_activations,
                                        output_activation=bottom_mlp_activations,
                                        dropout_rates=bottom_mlp_dropout, batch_norm=batch_norm)
        self.interaction_op = interaction_op
        if interaction_op == "dot":
            self.interact = InnerProductInteraction(num_fields=n_fields, output="inner_product")
            top_in = n_fields * (n_fields - 1) // 2 + (embedding_dim if self.dense_feats else 0)
        elif interaction_op == "cat":
            self.interact = nn.Flatten(start_dim=1)
            top_in = n_fields * embedding_dim
        else:
            raise ValueError(f"interaction_op={interaction_op} not supported")
        self.top_mlp = MLP_Block(input_dim=top_in, output_dim=1, hidden_units=list(top_mlp_units),
                                 hidden_activations=top_mlp_activations, output_activation=self.output_activation,
                                 dropout_rates=top_mlp_dropout, batch_norm=batch_norm)
        self.compile(kwargs["optimizer"], kwargs["loss"], learning_rate)
        self.reset_parameters()
        self.model_to_device()

    def forward(self, inputs):
        X = self.get_inputs(inputs)
        emb = self.embedding_layer(X)  # (batch, sparse fields, dim)
        if self.dense_feats:
            dense = self.bottom_mlp(torch.stack([X[k] for k in self.dense_feats], dim=1))  # (batch, dim)
            emb = torch.cat([emb, dense.unsqueeze(1)], dim=1)
        out = self.interact(emb)
        if self.interaction_op == "dot" and self.dense_feats:
            out = torch.cat([out, dense], dim=-1)
        return {"y_pred": self.top_mlp(out)}


class DCNv2(_Model):
    """DCNv2, parallel structure: a full-rank cross network (CrossNetV2) and a DNN side by side on the flat
    embeddings, concatenated into one logit. Numeric fields are embedded by FuxiCTR's FeatureEmbedding."""

    def __init__(self, feature_map, model_id="DCNv2", gpu=-1, model_structure="parallel", use_low_rank_mixture=False,
                 learning_rate=1e-3, embedding_dim=10, parallel_dnn_hidden_units=(), dnn_activations="ReLU",
                 num_cross_layers=3, net_dropout=0, batch_norm=False, embedding_regularizer=None,
                 net_regularizer=None, **kwargs):
        if model_structure != "parallel" or use_low_rank_mixture:
            raise ValueError("this bench runs DCNv2 parallel without the low-rank mixture only")
        super().__init__(feature_map, model_id=model_id, gpu=gpu, embedding_regularizer=embedding_regularizer,
                         net_regularizer=net_regularizer, **kwargs)
        self.embedding_layer = FeatureEmbedding(feature_map, embedding_dim)
        input_dim = feature_map.sum_emb_out_dim()
        self.crossnet = CrossNetV2(input_dim, num_cross_layers)
        self.parallel_dnn = MLP_Block(input_dim=input_dim, output_dim=None,
                                      hidden_units=list(parallel_dnn_hidden_units),
                                      hidden_activations=dnn_activations, output_activation=None,
                                      dropout_rates=net_dropout, batch_norm=batch_norm)
        self.fc = nn.Linear(input_dim + parallel_dnn_hidden_units[-1], 1)
        self.compile(kwargs["optimizer"], kwargs["loss"], learning_rate)
        self.reset_parameters()
        self.model_to_device()

    def forward(self, inputs):
        X = self.get_inputs(inputs)
        emb = self.embedding_layer(X, flatten_emb=True)  # (batch, fields * dim)
        out = torch.cat([self.crossnet(emb), self.parallel_dnn(emb)], dim=-1)
        return {"y_pred": self.output_activation(self.fc(out))}


MODELS = {"DLRM": DLRM, "DCNv2": DCNv2}


def encode(data: Path, work: Path) -> tuple[dict, float]:
    """Fit FuxiCTR's feature processor on ``data/train.csv`` and write ``work/{train,valid,test}.npz`` (once: a
    later call finds them). Returns the dataset params and the seconds it took."""
    spec = json.loads((data / "spec.json").read_text())
    cols = [{"name": spec["categorical"], "active": True, "dtype": "str", "type": "categorical"}]
    if spec["numeric"]:
        cols.append({"name": spec["numeric"], "active": True, "dtype": "float", "type": "numeric", "fill_na": 0.0})
    params = {"dataset_id": "data", "data_root": str(work), "feature_cols": cols,
              "label_col": {"name": spec["label"], "dtype": "float"}, "min_categr_count": 1}
    out = work / "data"
    t0 = time.perf_counter()
    if not (out / "feature_map.json").is_file():
        fp = FeatureProcessor(**params)
        train = fp.preprocess(fp.read_data(str(data / "train.csv"), data_format="csv"))
        fp.fit(train, rebuild_dataset=True, min_categr_count=1)
        for split in ("train", "valid", "test"):
            frame = fp.preprocess(fp.read_data(str(data / f"{split}.csv"), data_format="csv")).collect()
            batch = fp.transform({c: frame[c].to_numpy() for c in frame.columns})
            keep = list(fp.feature_map.features) + fp.feature_map.labels
            np.savez(out / f"{split}.npz", **{c: np.asarray(batch[c]) for c in keep})
    params.update({f"{s}_data": str(out / f"{s}.npz") for s in ("train", "valid", "test")})
    return params, time.perf_counter() - t0


def run(model_name: str, settings: dict, params: dict, seed: int, work: Path) -> dict:
    """Train one model with FuxiCTR's loop (early stopping and the kept best model by validation AUC), then score
    the validation and test splits with that best model."""
    p = {**BASE, **params, **settings, "model": model_name, "seed": seed, "gpu": -1,
         "model_root": str(work / f"ckpt_{model_name}_{seed}")}
    p["early_stop_patience"] = p.pop("patience", 2)  # the BARS configs' older name of the same setting
    seed_everything(seed=seed)
    t0 = time.perf_counter()
    feature_map = FeatureMap(p["dataset_id"], str(work / "data"))
    feature_map.load(str(work / "data" / "feature_map.json"), p)
    model = MODELS[model_name](feature_map, **p)
    Path(model.model_dir).mkdir(parents=True, exist_ok=True)  # where fit() keeps the best model
    train_gen, valid_gen = RankDataLoader(feature_map, stage="train", **p)
    model.fit(train_gen, validation_data=valid_gen, **p)
    valid = model.evaluate(valid_gen)
    test_gen = RankDataLoader(feature_map, stage="test", **p)
    test = model.evaluate(test_gen)
    # The test rows' probabilities in file order (the test loader does not shuffle), for bench/quality.py's paired
    # bootstrap of the AUC difference.
    predictions = work / f"test_pred_{model_name}_{seed}.npy"
    np.save(predictions, model.predict(test_gen))
    return {"model": model_name, "seed": seed, "epochs_run": model._epoch_index + 1,
            "valid_auc": float(valid["AUC"]), "valid_logloss": float(valid["logloss"]),
            "test_auc": float(test["AUC"]), "test_logloss": float(test["logloss"]),
            "test_predictions": str(predictions), "wall_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, type=Path, help="directory with train/valid/test.csv and spec.json")
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--settings", required=True, help="the model's settings as JSON")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--work", required=True, type=Path, help="FuxiCTR's encoded data and checkpoints")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args.work.mkdir(parents=True, exist_ok=True)
    params, encode_s = encode(args.data, args.work)
    print(json.dumps({"encode_s": round(encode_s, 2)}), flush=True)
    for seed in args.seeds:
        print(json.dumps(run(args.model, json.loads(args.settings), params, seed, args.work)), flush=True)


if __name__ == "__main__":
    main()
