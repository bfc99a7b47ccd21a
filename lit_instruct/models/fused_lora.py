"""LoRA projections as a few large ops instead of PEFT's many small ones, same adapters, same math.

PEFT computes each adapted projection as ``base(x) + B(A(dropout(x))) * scaling``: per projection two
skinny GEMMs, a scaled copy and an add of the whole ``(tokens, out)`` output, and in backward the same
again plus an add of every projection's input gradient. Here projections that share an input (q/k/v,
gate/up) run as one autograd node: their A matrices concatenated into one GEMM, each ``B`` added into
its base output in place (``addmm_``, the scaling folded in), and the input gradient accumulated in
place over all of them. A SwiGLU MLP (``down(silu(gate(x)) * up(x))``) is one node that keeps only
``gate(x)`` and ``up(x)`` for backward and recomputes the product, instead of four ``(tokens,
intermediate)`` tensors.

Nothing about the adapters changes: PEFT's modules and parameters stay where they are (adapter files
are PEFT's own), and each call falls back to PEFT's forward whenever it does anything this does not
(dropout, disabled or merged adapters, several adapters, DoRA, a base weight that trains, bases that
are not plain float tensors such as 4-bit layers or DTensor shards). Under autocast (``precision:
bf16-mixed``) a fused node runs wholly in autocast's dtype, as autocast runs PEFT's linear layers:
its input, base weights (no copy when they are stored in that dtype) and adapters cast to it, the
adapters' gradients returned in their own fp32. :func:`fuse_lora` checks every rewritten layer against
PEFT's own forward and backward at build time, in the dtype its base weights are stored in.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Parts:
    """One adapted projection at call time: frozen base ``weight``/``bias``, adapter ``a``/``b``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def to(self, dtype: torch.dtype) -> Parts:
        """The parts cast to ``dtype`` (autograd sees the casts: fp32 adapters get fp32 gradients)."""
        bias = None if self.bias is None else self.bias.to(dtype)
        return Parts(self.weight.to(dtype), bias, self.a.to(dtype), self.b.to(dtype), self.scaling)


CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 5e-3}
"""The build-time check's bound (relative to each tensor's largest entry) per dtype the check runs
in: fp32 tells a rewrite apart from rounding; bf16 and fp16 round every GEMM output to 8 and 11
mantissa bits, and the fused and PEFT's paths add in different orders."""


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes linear layers in for ``x``'s device, ``None`` when it is off."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def lora_parts(layer: nn.Module, x: torch.Tensor) -> Parts | None:
    """The parts of a PEFT LoRA ``Linear`` whose call on ``x`` is plain LoRA; ``None`` otherwise."""
    from peft.tuners.lora.layer import Linear as LoRALinear

    if type(layer) is not LoRALinear or layer.disable_adapters or layer.merged:
        return None
    adapters = layer.active_adapters
    if len(adapters) != 1 or adapters[0] in layer.lora_variant or adapters[0] not in layer.lora_A:
        return None
    name = adapters[0]
    base, a, b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    dropout = layer.lora_dropout[name]
    if type(base) is not nn.Linear or getattr(layer, "fan_in_fan_out", False) or b.bias is not None:
        return None
    if base.weight.requires_grad:  # a trained base weight: its gradient is PEFT's to compute
        return None
    if not (isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and dropout.p == 0)):
        return None
    if not x.dtype.is_floating_point:
        return None
    tensors = (base.weight, a.weight, b.weight)
    if any(type(t) is not nn.Parameter and type(t) is not torch.Tensor for t in tensors):
        return None  # a DTensor, a quantized tensor subclass, ...
    if any(t.device != x.device for t in tensors):
        return None
    if autocast_dtype(x) is None and any(t.dtype != x.dtype for t in tensors):
        return None  # mixed dtypes without autocast: PEFT casts the input to the adapter's dtype
    if not all(t.dtype.is_floating_point for t in tensors):
        return None
    return Parts(base.weight, base.bias, a.weight, b.weight, float(layer.scaling[name]))


def _stacked_a(parts: Sequence[Parts]) -> torch.Tensor:
    """``[A_1; A_2; ...]``, ``(sum r_i, K)`` (a copy of a few KiB when there are several)."""
    return parts[0].a if len(parts) == 1 else torch.cat([p.a for p in parts])


def _forward(x: torch.Tensor, parts: Sequence[Parts]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``x (M, K)`` -> each projection's output ``(M, N_i)``, and ``x @ [A_1; A_2; ...].T``."""
    xa = x @ _stacked_a(parts).T  # (M, sum r_i)
    outputs, at = [], 0
    for p in parts:
        y = x @ p.weight.T if p.bias is None else torch.addmm(p.bias, x, p.weight.T)
        r = p.a.shape[0]
        y.addmm_(xa[:, at : at + r], p.b.T, alpha=p.scaling)
        outputs.append(y)
        at += r
    return outputs, xa


def _backward(
    x: torch.Tensor,
    xa: torch.Tensor,
    grads: Sequence[torch.Tensor],
    parts: Sequence[Parts],
    needs: Sequence[bool],
) -> tuple[torch.Tensor | None, list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]]:
    """Gradients of :func:`_forward`: for ``x`` (if ``needs[0]``) and per projection (bias, A, B)."""
    gxa = torch.cat([(g @ p.b).mul_(p.scaling) for g, p in zip(grads, parts, strict=True)], dim=1)
    grad_a = gxa.T @ x  # (sum r_i, K)
    grad_x = None
    if needs[0]:
        grad_x = torch.mm(gxa, _stacked_a(parts))
        for g, p in zip(grads, parts, strict=True):
            grad_x.addmm_(g, p.weight)
    per: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]] = []
    at = 0
    for g, p in zip(grads, parts, strict=True):
        r = p.a.shape[0]
        grad_b = (g.T @ xa[:, at : at + r]).mul_(p.scaling)
        grad_bias = g.sum(0) if p.bias is not None and p.bias.requires_grad else None
        per.append((grad_bias, grad_a[at : at + r], grad_b))
        at += r
    return grad_x, per


def _flat(parts: Sequence[Parts]) -> list[Any]:
    return [t for p in parts for t in (p.weight, p.bias, p.a, p.b)]


def _save(
    ctx: Any, activations: Sequence[torch.Tensor], flat: Sequence[Any], scalings: Sequence[float]
) -> None:
    """Keep ``activations`` and the projections (``flat``, absent biases as empty tensors) for backward."""
    ctx.save_for_backward(*activations, *[t if t is not None else torch.empty(0) for t in flat])
    ctx.activations, ctx.scalings = len(activations), scalings
    ctx.has_bias = [flat[4 * i + 1] is not None for i in range(len(scalings))]


def _saved(ctx: Any) -> tuple[Sequence[torch.Tensor], list[Parts]]:
    """What :func:`_save` kept: the activations and the projections' parts."""
    saved = ctx.saved_tensors
    flat: list[Any] = list(saved[ctx.activations :])
    for i, has in enumerate(ctx.has_bias):
        if not has:
            flat[4 * i + 1] = None
    return saved[: ctx.activations], _parts(flat, ctx.scalings)


def _parts(flat: Sequence[Any], scalings: Sequence[float]) -> list[Parts]:
    return [
        Parts(flat[4 * i], flat[4 * i + 1], flat[4 * i + 2], flat[4 * i + 3], s)
        for i, s in enumerate(scalings)
    ]


def _grads_out(per: list[tuple[Any, Any, Any]]) -> list[Any]:
    return [g for bias, a, b in per for g in (None, bias, a, b)]  # the frozen base weight: None


class LoRAProjections(torch.autograd.Function):
    """Projections of one input ``x (M, K)``: ``(weight, bias, a, b)`` per projection, flat."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, scalings: tuple[float, ...], *flat: Any
    ) -> tuple[torch.Tensor, ...]:
        outputs, xa = _forward(x, _parts(flat, scalings))
        _save(ctx, (x, xa), flat, scalings)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        (x, xa), parts = _saved(ctx)
        grad_x, per = _backward(x, xa, [g.contiguous() for g in grads], parts, ctx.needs_input_grad)
        return (grad_x, None, *_grads_out(per))


class SwiGLULoRA(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))`` with LoRA on all three; backward recomputes the product."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scalings: tuple[float, ...], *flat: Any) -> torch.Tensor:
        parts = _parts(flat, scalings)
        (gate, up), xa = _forward(x, parts[:2])
        hidden = F.silu(gate).mul_(up)
        (out,), ha = _forward(hidden, parts[2:])
        _save(ctx, (x, xa, gate, up, ha), flat, scalings)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x, xa, gate, up, ha), parts = _saved(ctx)
        sigmoid = torch.sigmoid(gate)
        silu = gate * sigmoid
        grad_hidden, down = _backward(silu * up, ha, [grad_out.contiguous()], parts[2:], (True,))
        assert grad_hidden is not None
        grad_up = grad_hidden * silu
        del silu
        # d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
        grad_gate = grad_hidden.mul_(up).mul_(sigmoid * (1 + gate * (1 - sigmoid)))
        grad_x, gate_up = _backward(x, xa, [grad_gate, grad_up], parts[:2], ctx.needs_input_grad)
        return (grad_x, None, *_grads_out(gate_up + down))


def _apply(function: Any, x: torch.Tensor, parts: Sequence[Parts]) -> Any:
    """``function`` on ``x`` flattened to ``(M, K)``; under autocast, everything in its dtype."""
    flat = x.reshape(-1, x.shape[-1])
    dtype = autocast_dtype(x)
    if dtype is None:
        result = function.apply(flat, tuple(p.scaling for p in parts), *_flat(parts))
    else:
        with torch.autocast(x.device.type, enabled=False):
            cast = [p.to(dtype) for p in parts]
            result = function.apply(flat.to(dtype), tuple(p.scaling for p in parts), *_flat(cast))
    if isinstance(result, tuple):
        return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in result)
    return result.view(*x.shape[:-1], result.shape[-1])


class SharedInput:
    """Projections called one after another on the same input (q, k, v): the first call computes
    all of them in one :class:`LoRAProjections`, the others take their output; a call on another
    input, or a projection that cannot be fused at this call, runs PEFT's own forward."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.originals = [layer.forward for layer in layers]
        self.pending: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None

    def call(self, index: int, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not args and not kwargs:
            if index == 0:
                parts = [lora_parts(layer, x) for layer in self.layers]
                if all(p is not None for p in parts):
                    outputs = list(_apply(LoRAProjections, x, parts))  # type: ignore[arg-type]
                    first = outputs[0]
                    outputs[0] = None
                    self.pending = (x, outputs)
                    return first
            elif self.pending is not None and self.pending[0] is x and self.pending[1][index] is not None:
                out = self.pending[1][index]
                self.pending[1][index] = None
                if all(o is None for o in self.pending[1]):
                    self.pending = None
                assert out is not None
                return out
        self.pending = None
        return self.originals[index](x, *args, **kwargs)

    def install(self) -> None:
        for index, layer in enumerate(self.layers):
            layer.forward = lambda x, *a, _i=index, **k: self.call(_i, x, *a, **k)

    def remove(self) -> None:
        for layer in self.layers:
            del layer.forward  # back to the class's


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _swiglu_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(mlp: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not args and not kwargs:
            parts = [lora_parts(getattr(mlp, n), x) for n in MLP_PROJECTIONS]
            if all(p is not None for p in parts):
                return _apply(SwiGLULoRA, x, parts)  # type: ignore[arg-type]
        return original(x, *args, **kwargs)

    return forward


def _is_swiglu(mlp: nn.Module) -> bool:
    """A gated MLP of PEFT LoRA layers whose forward is ``down(silu(gate(x)) * up(x))`` by its parts
    (checked after)."""
    if not all(_plain(getattr(mlp, n, None)) for n in MLP_PROJECTIONS):
        return False
    act = type(getattr(mlp, "act_fn", None))
    return act is nn.SiLU or (
        act.__name__ == "SiLUActivation" and act.__module__ == "transformers.activations"
    )


@dataclass
class FusedLayers:
    """What :func:`fuse_lora` rewrote, and what it left on PEFT's path because its check failed."""

    mlps: int = 0
    attention_groups: int = 0
    left_unfused: list[str] = field(default_factory=list)


def fuse_lora(model: nn.Module, check: bool = True) -> FusedLayers:
    """Rewrite, in each decoder layer of the PEFT ``model``, the SwiGLU MLP and the q/k/v projections
    (:class:`SharedInput`) to run fused. With ``check``, each rewritten layer's output and adapter
    gradients on a few random tokens are compared with PEFT's own (1e-4 relative, float32); a layer
    that differs is restored to PEFT's path, named in ``left_unfused`` and in a warning.
    """
    fused = FusedLayers()
    for name, module in model.named_modules():
        if _is_swiglu(module):
            if _fuse_mlp(module, check):
                fused.mlps += 1
            else:
                fused.left_unfused.append(name)
        if all(_plain(getattr(module, n, None)) for n in QKV_PROJECTIONS):
            if _fuse_qkv(module, check):
                fused.attention_groups += 1
            else:
                fused.left_unfused.append(name)
    if fused.left_unfused:
        warnings.warn(
            f"fused LoRA left {len(fused.left_unfused)} layers on PEFT's own path (their fused form differs "
            f"from PEFT's forward): {', '.join(fused.left_unfused[:4])}"
            + (" ..." if len(fused.left_unfused) > 4 else ""),
            stacklevel=2,
        )
    return fused


def _fuse_mlp(mlp: nn.Module, check: bool) -> bool:
    mlp.forward = types.MethodType(_swiglu_forward(mlp.forward), mlp)
    return not check or _check(
        mlp.gate_proj,
        _lora_params([mlp]),
        lambda x: [mlp(x)],
        lambda x: [type(mlp).forward(mlp, x)],
        functools.partial(_restore, mlp),
    )


def _fuse_qkv(attention: nn.Module, check: bool) -> bool:
    group = SharedInput([getattr(attention, n) for n in QKV_PROJECTIONS])
    group.install()
    return not check or _check(
        group.layers[0],
        _lora_params(group.layers),
        lambda x: [layer(x) for layer in group.layers],
        lambda x: [original(x) for original in group.originals],
        group.remove,
    )


def _plain(layer: nn.Module | None) -> bool:
    """A PEFT LoRA ``Linear`` over a plain ``nn.Linear`` (whether a call is fused is decided per call)."""
    from peft.tuners.lora.layer import Linear as LoRALinear

    return type(layer) is LoRALinear and type(layer.base_layer) is nn.Linear


def _restore(module: nn.Module) -> None:
    del module.forward


def _lora_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for n, p in m.named_parameters() if "lora_" in n and p.requires_grad]


def _outputs_and_grads(
    run: Callable[[torch.Tensor], list[torch.Tensor]], x: torch.Tensor, params: list[nn.Parameter]
) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]):  # the same dropout masks, if any, for both runs
        torch.manual_seed(0)
        outputs = run(x)
    loss = sum(o.square().sum() for o in outputs)
    grads = torch.autograd.grad(loss, params) if params else ()  # type: ignore[arg-type]  # frozen: forward only
    return [o.detach() for o in outputs] + list(grads)


@torch.enable_grad()
def _check(
    first: Any,
    params: list[nn.Parameter],
    fast: Callable[[torch.Tensor], list[torch.Tensor]],
    slow: Callable[[torch.Tensor], list[torch.Tensor]],
    undo: Callable[[], None],
) -> bool:
    """``fast`` (the rewrite) against ``slow`` (PEFT's forward) on a few random tokens as wide as the
    input of the projection ``first``: outputs and the gradients of ``params``, within
    :data:`CHECK_TOLERANCE` of the base weights' dtype (a bf16 or fp16 base: both under autocast to
    it, as ``bf16-mixed`` runs them); on a difference, ``undo`` and return False. Skipped (True) for a
    weightless (meta) or non-float model."""
    weight = next(first.parameters())
    if weight.is_meta or not weight.dtype.is_floating_point:
        return True
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, int(first.in_features), generator=generator).to(weight.device, weight.dtype)
    low = weight.dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(weight.device.type, dtype=weight.dtype, enabled=low):
        pairs = zip(_outputs_and_grads(fast, x, params), _outputs_and_grads(slow, x, params), strict=True)
    tolerance = CHECK_TOLERANCE.get(weight.dtype, CHECK_TOLERANCE[torch.float32])
    for f, s in pairs:
        error, scale = float((f.float() - s.float()).abs().max()), float(s.float().abs().max()) or 1.0
        if error > tolerance * scale:
            undo()
            return False
    return True
