"""``[model]``: the DLRM architecture."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recstack.embedding.dynamic import DynamicIdsConfig
from recstack.errors import ConfigError


@dataclass
class ModelConfig:
    """DLRM architecture. ``bottom_mlp`` ends in ``embedding_dim`` for the dot interaction; ``top_mlp``
    ends in 1 (a logit). ``max_table_size`` caps every table's rows (0 = no cap); ids are taken modulo it.
    ``qr_collisions`` m >= 2 turns every table of more than ``qr_threshold`` rows into quotient-remainder
    tables (ceil(n / m) + m rows, combined by ``qr_operation``; ``recstack.embedding.qr``); 0 = off.

    Regularisation of both MLPs' hidden layers (every layer but the last of each MLP): ``mlp_norm`` normalises
    each hidden layer's output before its ReLU (``batch``: BatchNorm1d, ``layer``: LayerNorm), ``dropout``
    zeroes each hidden activation with that probability in training (after the ReLU; identity in eval).
    Both off by default, and then the MLPs are exactly today's (the fused training step, same numerics).
    ``bottom_dropout`` >= 0 gives the bottom MLP its own rate (FuxiCTR DLRM's ``bottom_mlp_dropout`` beside
    ``top_mlp_dropout``); -1 (default) uses ``dropout``. ``mlp_bias_init``: every MLP layer's bias starts at
    N(0, 1/fan_out) (``normal``, the DLRM reference; default) or at 0 (``zero``, FuxiCTR's reset_parameters; the
    weights are the same values either way). It matters most for the top MLP's last layer: ``normal`` gives the
    logit a starting offset drawn from N(0, 1), which Adam at a learning rate of 1e-3 moves about 1e-3 a step.

    ``interaction = "fm"`` is DeepFM: every table holds ``embedding_dim`` + 1 columns, the last the feature's
    first-order weight; the factorization machine's logit (bias, first and second order) is added to the top
    MLP's, whose input is concat(bottom MLP output, the features' vectors) (``recstack.models.interaction.
    FMInteraction``). Not with ``table_dims`` or quotient-remainder tables.

    ``interaction = "dcn"``: DCNv2's cross network of ``dcn_layers`` layers, of rank ``dcn_low_rank`` (0: full
    rank, FuxiCTR's CrossNetV2), in ``dcn_structure`` (FuxiCTR's ``model_structure``): ``stacked`` (the top MLP on
    the cross output; top_mlp = [1] is crossnet_only), ``parallel`` (a DNN of ``dcn_parallel_mlp`` beside it, both
    outputs concatenated into the top MLP, [1] for FuxiCTR's fc) or ``stacked_parallel`` (also a DNN of
    ``dcn_stacked_mlp`` on the cross output). ``dropout`` and ``mlp_norm`` regularise those DNNs' every layer
    (``recstack.models.interaction.DCNv2Interaction``).

    ``table_dims`` {table name: dim} gives some tables their own embedding dim (mixed-dimension embeddings):
    such a table is looked up at that dim and a learned per-table linear map (a dense parameter) projects its
    pooled vectors to ``embedding_dim``, so the interaction sees every feature at ``embedding_dim``; the other
    tables have ``embedding_dim``. Table names are the data's (Criteo ``C1``..``C26``, a schema's feature or
    ``table = ...`` names). Empty by default: the model is exactly today's.

    ``embedding_init_bound`` > 0 draws every table's initial rows from uniform(-bound, bound); 0 (default) keeps the
    DLRM reference's uniform(-1/sqrt(rows), 1/sqrt(rows)), whose bound is large for small tables (0.58 for 3 rows,
    0.35 for 8): on data sets of a few small categorical fields those random starting values are noise the
    interaction multiplies. FuxiCTR starts every table at normal(0, 1e-4).

    ``dynamic_ids`` (``[model.dynamic_ids]``, ``recstack.embedding.dynamic``): tables keyed by raw int64 ids
    through an id map with admission and eviction, each of ``capacity`` rows (not the data's id range)."""

    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    interaction: Literal["dot", "cat", "dcn", "fm"] = "dot"
    interaction_itself: bool = False
    dcn_layers: int = 3
    dcn_low_rank: int = 512
    dcn_structure: Literal["stacked", "parallel", "stacked_parallel"] = "stacked"
    dcn_parallel_mlp: list[int] = field(default_factory=list)
    dcn_stacked_mlp: list[int] = field(default_factory=list)
    max_table_size: int = 0
    qr_collisions: int = 0
    qr_threshold: int = 200
    qr_operation: Literal["mult", "add"] = "mult"
    dropout: float = 0.0
    bottom_dropout: float = -1.0
    mlp_norm: Literal["none", "batch", "layer"] = "none"
    mlp_bias_init: Literal["normal", "zero"] = "normal"
    table_dims: dict[str, int] = field(default_factory=dict)
    embedding_init_bound: float = 0.0
    dynamic_ids: DynamicIdsConfig = field(default_factory=DynamicIdsConfig)

    def validate(self) -> None:
        """Ranges and widths; each ConfigError names the field. The widths the interaction needs of the bottom
        MLP depend on the data (a data set without dense features has no bottom MLP): ``check_dense``."""
        if self.embedding_dim <= 0:
            raise ConfigError("model.embedding_dim: must be positive")
        for name, low in (("dcn_layers", 0), ("dcn_low_rank", 0), ("max_table_size", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"model.{name}: must be >= {low}, got {getattr(self, name)}")
        for name, widths in (("bottom_mlp", self.bottom_mlp), ("top_mlp", self.top_mlp),
                             ("dcn_parallel_mlp", self.dcn_parallel_mlp), ("dcn_stacked_mlp", self.dcn_stacked_mlp)):
            if any(w < 1 for w in widths):
                raise ConfigError(f"model.{name}: every width must be >= 1, got {widths}")
        if self.qr_collisions < 0 or self.qr_collisions == 1 or self.qr_threshold < 0:
            raise ConfigError(f"model.qr_collisions / model.qr_threshold: need qr_collisions 0 (off) or >= 2 and "
                              f"qr_threshold >= 0, got {self.qr_collisions} / {self.qr_threshold}")
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ConfigError(f"model.top_mlp: must end in 1 (a logit), got {self.top_mlp}")
        if not 0.0 <= self.embedding_init_bound < float("inf"):
            raise ConfigError(f"model.embedding_init_bound: must be a finite number >= 0 (0: the DLRM reference's "
                              f"1/sqrt(rows)), got {self.embedding_init_bound}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")
        if not (self.bottom_dropout == -1.0 or 0.0 <= self.bottom_dropout < 1.0):
            raise ConfigError(f"model.bottom_dropout: must be in [0, 1), or -1 for model.dropout's rate, got "
                              f"{self.bottom_dropout}")
        self._check_dcn()
        if self.dynamic_ids.enabled:
            self.dynamic_ids.validate()
            if self.qr_collisions:
                raise ConfigError("model.dynamic_ids: not supported with quotient-remainder tables (model.qr_collisions"
                                  f"={self.qr_collisions}): a dynamic table is already sized by its capacity")
        if self.interaction == "fm" and (self.table_dims or self.qr_collisions):
            key = "table_dims" if self.table_dims else "qr_collisions"
            raise ConfigError(f"model.{key}: not supported with model.interaction = 'fm' (DeepFM's tables carry "
                              "the first-order weight as one more column of embedding_dim + 1); use one or the other")
        for name, dim in self.table_dims.items():
            if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
                raise ConfigError(f"model.table_dims.{name}: must be a positive integer, got {dim!r}")
        if self.table_dims and self.qr_collisions:
            raise ConfigError("model.table_dims: per-table dims are not supported with quotient-remainder tables "
                              f"(model.qr_collisions={self.qr_collisions}); use one or the other")

    def _check_dcn(self) -> None:
        """The DNNs ``dcn_structure`` needs are given, and none it does not use."""
        st = self.dcn_structure if self.interaction == "dcn" else None
        used = {"dcn_parallel_mlp": st in ("parallel", "stacked_parallel"), "dcn_stacked_mlp": st == "stacked_parallel"}
        for name, use in used.items():
            given = bool(getattr(self, name))
            if use and not given:
                raise ConfigError(f"model.{name}: model.dcn_structure = {st!r} needs its hidden units, got []")
            if given and not use:
                why = f"model.dcn_structure = {st!r}" if st else f"model.interaction = {self.interaction!r}"
                raise ConfigError(f"model.{name}: not used with {why} (with 'stacked' the top MLP is the DNN on the "
                                  "cross network); leave it [] or change that")

    @property
    def table_width(self) -> int:
        """The columns of a table of ``embedding_dim``: one more with ``interaction = "fm"`` (the first-order
        weight)."""
        return self.embedding_dim + (1 if self.interaction == "fm" else 0)

    def table_dim(self, name: str) -> int:
        """The embedding dim of table ``name``: its ``table_dims`` entry, else ``table_width``."""
        return self.table_dims.get(name, self.table_width)

    def check_table_names(self, names: list[str]) -> None:
        """Every ``table_dims`` key against the data's table names, checked when the model is built."""
        for name in self.table_dims:
            if name not in names:
                shown = ", ".join(dict.fromkeys(names))
                raise ConfigError(f"model.table_dims.{name}: the data has no table {name!r} (tables: {shown})")

    def check_dense(self, num_dense: int) -> None:
        """The bottom MLP against the data's ``num_dense`` dense features, checked when the model is built (only
        then is the data known): with dense features the dot interaction needs it to end in ``embedding_dim``;
        without them there is no bottom MLP and ``bottom_mlp`` is not used."""
        if num_dense and not self.bottom_mlp:
            raise ConfigError(f"model.bottom_mlp: the data has {num_dense} dense features, which need a bottom MLP "
                              f"(at least one layer{', ending in embedding_dim' if self.interaction == 'dot' else ''}"
                              f"), got []")
        if num_dense and self.interaction == "dot" and self.bottom_mlp and self.bottom_mlp[-1] != self.embedding_dim:
            raise ConfigError(f"model.bottom_mlp: the dot interaction needs it to end in "
                              f"embedding_dim={self.embedding_dim}, got {self.bottom_mlp}")
