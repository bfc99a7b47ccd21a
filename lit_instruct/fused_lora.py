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
are not plain float tensors such as 4-bit layers or DTensor shards, autocast). :func:`fuse_lora`
checks every rewritten layer against PEFT's own forward and backward at build time.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    if torch.is_autocast_enabled(x.device.type) or not x.dtype.is_floating_point:
        return None
    tensors = (base.weight, a.weight, b.weight)
    if any(type(t) is not nn.Parameter and type(t) is not torch.Tensor for t in tensors):
        return None  # a DTensor, a quantized tensor subclass, ...
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        return None
    return Parts(base.weight, base.bias, a.weight, b.weight, float(layer.scaling[name]))


def _forward(x: torch.Tensor, parts: Sequence[Parts]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``x (M, K)`` -> each projection's output ``(M, N_i)``, and ``x @ [A_1; A_2; ...].T``."""
    a = parts[0].a if len(parts) == 1 else torch.cat([p.a for p in parts])
    xa = x @ a.T  # (M, sum r_i)
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
    a = parts[0].a if len(parts) == 1 else torch.cat([p.a for p in parts])
    grad_a = gxa.T @ x  # (sum r_i, K)
    grad_x = None
    if needs[0]:
        grad_x = torch.mm(gxa, a)
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
        parts = _parts(flat, scalings)
        outputs, xa = _forward(x, parts)
        ctx.save_for_backward(x, xa, *[t if t is not None else torch.empty(0) for t in flat])
        ctx.scalings, ctx.has_bias = scalings, [p.bias is not None for p in parts]
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        x, xa, *flat = ctx.saved_tensors
        for i, has in enumerate(ctx.has_bias):
            flat[4 * i + 1] = flat[4 * i + 1] if has else None
        parts = _parts(flat, ctx.scalings)
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
        ctx.save_for_backward(x, xa, gate, up, ha, *[t if t is not None else torch.empty(0) for t in flat])
        ctx.scalings, ctx.has_bias = scalings, [p.bias is not None for p in parts]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, xa, gate, up, ha, *flat = ctx.saved_tensors
        for i, has in enumerate(ctx.has_bias):
            flat[4 * i + 1] = flat[4 * i + 1] if has else None
        parts = _parts(flat, ctx.scalings)
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
    flat = x.reshape(-1, x.shape[-1])
    result = function.apply(flat, tuple(p.scaling for p in parts), *_flat(parts))
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


def _swiglu_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(mlp: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not args and not kwargs:
            parts = [lora_parts(getattr(mlp, n), x) for n in ("gate_proj", "up_proj", "down_proj")]
            if all(p is not None for p in parts):
                return _apply(SwiGLULoRA, x, parts)  # type: ignore[arg-type]
        return original(x, *args, **kwargs)

    return forward


def _is_swiglu(mlp: nn.Module) -> bool:
    """A gated MLP whose forward is ``down(silu(gate(x)) * up(x))`` by its parts (checked after)."""
    names = ("gate_proj", "up_proj", "down_proj")
    if not all(hasattr(mlp, n) for n in names):
        return False
    act = type(getattr(mlp, "act_fn", None))
    return act is nn.SiLU or (
        act.__name__ == "SiLUActivation" and act.__module__ == "transformers.activations"
    )


@dataclass
class FusedLayers:
    """What :func:`fuse_lora` rewrote."""

    mlps: int = 0
    attention_groups: int = 0


def fuse_lora(model: nn.Module, check: bool = True) -> FusedLayers:
    """Rewrite, in each decoder layer of the PEFT ``model``, the SwiGLU MLP and the q/k/v projections
    (:class:`SharedInput`) to run fused. With ``check``, each rewritten layer's output and adapter
    gradients on a few random tokens are compared with PEFT's own (1e-4 relative, float32).

    Raises:
        RuntimeError: when a rewritten layer differs from PEFT's (it is restored first).
    """
    fused = FusedLayers()
    for module in model.modules():
        if _is_swiglu(module) and all(
            _plain(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            original = module.forward
            module.forward = types.MethodType(_swiglu_forward(original), module)
            if check:
                _check(module, _width(module.gate_proj), functools.partial(_restore, module), "mlp")
            fused.mlps += 1
        names = ("q_proj", "k_proj", "v_proj")
        if all(_plain(getattr(module, n, None)) for n in names):
            group = SharedInput([getattr(module, n) for n in names])
            group.install()
            if check:
                _check_group(group)
            fused.attention_groups += 1
    return fused


def _plain(layer: nn.Module | None) -> bool:
    """A PEFT LoRA ``Linear`` over a plain ``nn.Linear`` (whether a call is fused is decided per call)."""
    from peft.tuners.lora.layer import Linear as LoRALinear

    return type(layer) is LoRALinear and type(layer.base_layer) is nn.Linear


def _width(layer: Any) -> int:
    return int(layer.in_features)


def _restore(module: nn.Module) -> None:
    del module.forward


def _adapter_grads(module: nn.Module, run: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    params = [p for n, p in module.named_parameters() if "lora_" in n and p.requires_grad]
    with torch.random.fork_rng(devices=[]):  # the same dropout masks, if any, for both runs
        torch.manual_seed(0)
        out = run()
    grads = torch.autograd.grad(out.square().sum(), params) if params else ()  # frozen: forward only
    return [out.detach(), *grads]


def _compare(fast: list[torch.Tensor], slow: list[torch.Tensor], what: str, undo: Callable[[], None]) -> None:
    for f, s in zip(fast, slow, strict=True):
        scale = float(s.abs().max()) or 1.0
        if float((f - s).abs().max()) > 1e-4 * scale:
            undo()
            raise RuntimeError(
                f"fused LoRA {what} differs from PEFT's own forward (max {float((f - s).abs().max()):.3g}): "
                "set model.fuse_lora: false and report it"
            )


def _probe(module: nn.Module, width: int) -> torch.Tensor | None:
    weight = next(module.parameters())
    if weight.is_meta or not weight.dtype.is_floating_point:
        return None
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, width, generator=generator, dtype=torch.float32).to(weight.device, weight.dtype)
    return x


@torch.enable_grad()
def _check(module: nn.Module, width: int, undo: Callable[[], None], what: str) -> None:
    x = _probe(module, width)
    if x is None:
        return
    fast = _adapter_grads(module, lambda: module(x))
    slow = _adapter_grads(module, lambda: type(module).forward(module, x))
    _compare(fast, slow, what, undo)


@torch.enable_grad()
def _check_group(group: SharedInput) -> None:
    x = _probe(group.layers[0], _width(group.layers[0]))
    if x is None:
        return
    params = [
        p for layer in group.layers for n, p in layer.named_parameters() if "lora_" in n and p.requires_grad
    ]

    def run(calls: Sequence[Callable[..., torch.Tensor]]) -> list[torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            outs = [call(x) for call in calls]
        loss = sum(o.square().sum() for o in outs)
        grads = torch.autograd.grad(loss, params) if params else ()  # type: ignore[arg-type]
        return [o.detach() for o in outs] + list(grads)

    fast = run([layer.__call__ for layer in group.layers])
    slow = run(group.originals)
    _compare(fast, slow, "q/k/v projections", group.remove)
