"""Multi-layer perceptrons whose training step runs as one autograd node.

``MLP`` is an ``nn.Sequential`` of ``nn.Linear`` layers with ``nn.ReLU`` between them (and optionally after the
last), so its parameters, state_dict keys and eval-mode forward are those of the plain Sequential. In training
its forward and backward are hand-written: ReLU is applied in place on each layer's output (that output is
also the next layer's input, so nothing else is kept for backward), there is one autograd node instead of
three per layer, and on CPU weight gradients are computed in the orientation that keeps MKL on its fast
path (see ``_weight_grad_transposed``).

With regularisation (``norm`` and/or ``dropout`` in the hidden layers) the Sequential also holds normalisation
and dropout modules; the hand-written step covers Linear and ReLU only, so such an MLP always runs the plain
modules' forward and autograd's backward (an MLP without them keeps the fused step, bit for bit).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn
from torch.autograd.function import once_differentiable


def _weight_grad_transposed(batch: int, in_features: int, device: torch.device) -> bool:
    """Whether to compute a layer's weight gradient as (x^T g)^T rather than g^T x.

    When ``in_features`` is not a multiple of 16 (13 dense features, 367 DLRM interaction outputs), MKL's
    sgemm is slower if that odd size is the row length of the product it writes: 3x for 13 columns, 1.25x
    for 367 (Zen 4). The transposed product avoids that, but autograd then copies the [out, in] result into
    the parameter's layout, a strided copy that costs about as much as a 200-sample product of a wide layer.
    Measured: worth it for narrow inputs at any batch, for wide ones only at large batches, which
    ``batch >= 4 * in_features`` captures. cuBLAS has no such cliff, so this is done on CPU only.
    """
    return device.type == "cpu" and in_features % 16 != 0 and batch >= 4 * in_features


class _FusedMLP(torch.autograd.Function):
    """x [B, in] -> y [B, out] through Linear layers, ReLU after every layer flagged in ``relu``."""

    @staticmethod
    def forward(ctx, x, relu, *params):
        h = x
        outs = []
        for i, on in enumerate(relu):
            h = torch.addmm(params[2 * i + 1], h, params[2 * i].t())  # [B, out_i]
            if on:
                h.relu_()  # in place: backward only needs where the output is positive
            outs.append(h)
        ctx.relu = relu
        ctx.save_for_backward(x, *outs, *params)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        n = len(ctx.relu)
        saved = ctx.saved_tensors
        x, outs, params = saved[0], saved[1 : n + 1], saved[n + 1 :]
        grads: list[torch.Tensor | None] = [None] * (2 * n)
        g = grad
        for i in reversed(range(n)):
            w = params[2 * i]  # [out_i, in_i]
            if ctx.relu[i]:
                g = torch.ops.aten.threshold_backward(g, outs[i], 0)  # zero where ReLU clipped
            inp = outs[i - 1] if i > 0 else x
            if ctx.needs_input_grad[2 + 2 * i]:
                flip = _weight_grad_transposed(g.shape[0], w.shape[1], w.device)
                grads[2 * i] = inp.t().mm(g).t() if flip else g.t().mm(inp)  # [out_i, in_i]
            if ctx.needs_input_grad[3 + 2 * i]:
                grads[2 * i + 1] = g.sum(0)
            if i > 0 or ctx.needs_input_grad[0]:
                g = g.mm(w)  # [B, in_i]
        gx = g if ctx.needs_input_grad[0] else None
        return gx, None, *grads


Norm = Literal["none", "batch", "layer"]
BiasInit = Literal["normal", "zero"]


def mlp_layers(sizes: list[int], last_activation: bool, dropout: float = 0.0, norm: Norm = "none",
               hidden_last: bool = False, bias_init: BiasInit = "normal") -> list[nn.Module]:
    """Linear layers sizes[0] -> ... -> sizes[-1], ReLU between (and after the last with ``last_activation``),
    initialised as in the DLRM reference from torch's global RNG, layer by layer:
    W ~ N(0, sqrt(2 / (fan_in + fan_out))), b ~ N(0, sqrt(1 / fan_out)).

    Every hidden layer (all but the last) is Linear -> [BatchNorm1d | LayerNorm] -> ReLU -> [Dropout(dropout)]
    with ``norm`` / ``dropout`` > 0 (as FuxiCTR's MLP blocks); the last layer never gets them (the bottom MLP's
    output is an interaction vector, the top MLP's a logit). The normalisations draw nothing (weight 1, bias 0),
    so the Linear layers get the same values with or without them. ``hidden_last``: the last layer is a hidden
    one too (norm, ReLU, dropout): a block whose output feeds further layers (FuxiCTR's MLP block without an
    output layer, as DCNv2's DNNs). ``bias_init = "zero"`` starts every bias at 0 (FuxiCTR's reset_parameters)
    after drawing it as "normal" does, so the weights are the same values either way."""
    layers: list[nn.Module] = []
    last = len(sizes) - 1 if hidden_last else len(sizes) - 2
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        lin = nn.Linear(m, n)
        with torch.no_grad():
            lin.weight.normal_(0.0, math.sqrt(2.0 / (m + n)))
            lin.bias.normal_(0.0, math.sqrt(1.0 / n))
            if bias_init == "zero":  # drawn first all the same: the weights after it stay those of "normal"
                lin.bias.zero_()
        layers.append(lin)
        if i < last and norm != "none":
            layers.append(nn.BatchNorm1d(n) if norm == "batch" else nn.LayerNorm(n))
        if i < last or last_activation or hidden_last:
            layers.append(nn.ReLU())
        if i < last and dropout > 0.0:
            layers.append(nn.Dropout(dropout))
    return layers


class MLP(nn.Sequential):
    """The layers of ``mlp_layers``; input [B, sizes[0]] -> [B, sizes[-1]]."""

    def __init__(self, sizes: list[int], last_activation: bool, dropout: float = 0.0, norm: Norm = "none",
                 hidden_last: bool = False, bias_init: BiasInit = "normal") -> None:
        layers = mlp_layers(sizes, last_activation, dropout, norm, hidden_last, bias_init)
        super().__init__(*layers)
        after = [*layers[1:], None]  # whether a ReLU follows each Linear (read by the fused step: plain MLPs only)
        self._relu = tuple(isinstance(after[i], nn.ReLU) for i, m in enumerate(layers) if isinstance(m, nn.Linear))
        self._num_modules = len(layers)
        # The fused step knows Linear and ReLU only: with normalisation or dropout the plain modules run.
        self._plain = all(isinstance(m, (nn.Linear, nn.ReLU)) for m in layers)

    def _fusable(self, x: torch.Tensor) -> bool:
        """The hand-written step covers plain float 2-D inputs of Linear/ReLU layers built in __init__ only."""
        return (
            self._plain
            and len(self) == self._num_modules  # nobody appended or removed modules since
            and x.dim() == 2
            and x.dtype == self[0].weight.dtype
            and not torch.is_autocast_enabled(x.device.type)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not self._fusable(x):
            return super().forward(x)
        params = [p for m in self if isinstance(m, nn.Linear) for p in (m.weight, m.bias)]
        return _FusedMLP.apply(x, self._relu, *params)
