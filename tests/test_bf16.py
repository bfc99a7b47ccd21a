"""bf16 where the hardware has it: ``precision: auto`` and ``dtype: auto`` (both branches of the
detection, forced), and bf16 results held to a tolerance table against float64 and fp32.

Tolerances are errors relative to each tensor's largest entry (Liger's style, per dtype). bf16 keeps
8 mantissa bits: one rounding is 2^-9 = 2e-3 relative, and a GEMM's output, rounded once after an
fp32 accumulation, is within a few of those; gradients, products of rounded factors, within 1e-2.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from lit_instruct import precision
from lit_instruct.data.collate import PadCollator
from lit_instruct.models.fused_lora import QKV_PROJECTIONS, fuse_lora
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.precision import auto_precision, base_dtype, cpu_bf16, cuda_bf16
from lit_instruct.train.module import InstructLoRAModule
from lit_instruct.train.trainer import InstructTrainer
from tests.families import FAMILIES, build_family
from tests.helpers import make, trainer
from tests.test_families import VOCAB, lora_grads, our_loss, own_loss, samples
from tests.test_fused_lora import NotSwiGLU, tiny_peft

ROOT = Path(__file__).resolve().parents[1]
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SPR = "flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"
ZEN3 = "flags\t\t: fpu sse2 avx avx2 fma\n"

OP_TOLERANCE = {"output": 1e-2, "gradient": 2e-2}
"""Fused LoRA nodes under bf16 autocast vs float64 (outputs; adapter gradients)."""

FAMILY_LOSS = 2e-3
"""A family's bf16 step loss vs its fp32 loss (relative): the loss sums thousands of fp32 terms."""
FAMILY_GRADIENT = 3e-2
"""A family's bf16 LoRA gradients vs fp32 (norm of the difference / norm), unless below."""
FAMILY_GRADIENT_WIDER = {
    # soft-capped logits or attention (caps of 0.5-1 in the tiny configs, so tanh bends): the cap's
    # derivative 1 - tanh^2 amplifies bf16's rounding of what goes in; the model's own bf16 path
    # errs as much (checked below against it)
    "gemma2": 0.2,
    "gemma3": 0.1,
    "gemma3n": 0.15,
    "gemma4": 0.7,
    "glm4_moe": 0.35,  # top-k routing on near-tied router scores: bf16 sends tokens to other experts
    "phi": 0.1,  # GELU MLPs and partial rotary on LayerNorm: the model's own bf16 errs twice as much
    "starcoder2": 0.1,
}
OWN_FACTOR = 1.5
"""Our bf16 gradients err at most this much more than the model's own bf16 path (peft's layers,
the reference loss) does, plus 1e-2: they round in other places, never systematically worse."""


# -- the detection ------------------------------------------------------------------------------


def test_a_cpu_with_avx512_bf16_or_amx_bf16_and_avx512_kernels_does_bf16() -> None:
    assert cpu_bf16(ZEN4, "AVX512")[0] and cpu_bf16(SPR, "AVX512")[0]
    native, reason = cpu_bf16(ZEN3, "AVX2")
    assert not native and "emulated" in reason
    native, reason = cpu_bf16(ZEN4, "AVX2")  # ATEN_CPU_CAPABILITY=avx2, or a build without AVX-512 kernels
    assert not native and "AVX2 kernels" in reason
    assert not cpu_bf16("", "AVX512")[0]


def test_cuda_from_compute_capability_8() -> None:
    assert cuda_bf16((8, 0))[0] and cuda_bf16((9, 0))[0]
    assert not cuda_bf16((7, 5))[0]


def test_auto_follows_the_detection_on_this_machine_and_when_forced(monkeypatch) -> None:
    native = cpu_bf16()[0]
    assert auto_precision("cpu").precision == ("bf16-mixed" if native else "32-true")
    assert ("avx512_bf16" in precision.cpu_flags() or "amx_bf16" in precision.cpu_flags()) >= native
    for forced, expected in ((True, ("bf16-mixed", "bfloat16")), (False, ("32-true", "float32"))):
        monkeypatch.setattr(precision, "cpu_bf16", lambda f=forced: (f, "forced"))
        choice = auto_precision("cpu")
        assert (choice.precision, choice.dtype) == expected
        assert InstructTrainer(accelerator="cpu", precision="auto", logger=False).precision == expected[0]
        assert InstructTrainer(accelerator="cpu", precision="32-true", logger=False).precision == "32-true"
        assert base_dtype("auto", choice.precision) == expected[1]
    assert base_dtype("float16", "bf16-mixed") == "float16"  # the user's explicit dtype wins


def test_the_shipped_configs_choose_precision_by_hardware() -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        assert config["trainer"]["precision"] == "auto", path.name
        assert config["model"].get("dtype", "auto") == "auto", path.name


@pytest.mark.parametrize("native", [True, False])
def test_the_cli_resolves_auto_before_the_config_check(native, monkeypatch, tmp_path, capsys) -> None:
    from lit_instruct.cli import CheckCLI

    monkeypatch.setattr(precision, "cpu_bf16", lambda: (native, "forced"))
    args = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    for extra, expected in (([], native), (["--trainer.precision", "32-true"], False)):
        cli = CheckCLI(args=args + extra, run=False)
        config = cli.subcommand_config()
        assert config["trainer"]["precision"] == ("bf16-mixed" if expected else "32-true")
        assert config["model"]["dtype"] == ("bfloat16" if expected else "float32")


def test_a_bf16_base_chosen_by_auto_goes_back_to_fp32_under_an_fp32_trainer(
    monkeypatch, tiny_model_dir, chat_file, tmp_path
) -> None:
    monkeypatch.setattr(precision, "cpu_bf16", lambda: (True, "forced"))
    module, data = make(tiny_model_dir, chat_file, dtype="auto")
    assert module.lm_head.weight.dtype == torch.bfloat16
    trainer(tmp_path, max_steps=1, precision="32-true").fit(module, datamodule=data)
    assert {p.dtype for p in module.parameters()} == {torch.float32}


# -- the fused LoRA nodes under bf16 ------------------------------------------------------------


def _in_bf16(model: nn.Module) -> nn.Module:
    """The base's weights stored in bf16 (``dtype: auto`` under bf16), the adapters fp32."""
    for name, parameter in model.named_parameters():
        if "lora_" not in name:
            parameter.data = parameter.data.bfloat16()
    return model


def _op(model: nn.Module, op: str) -> tuple[nn.Module, object]:
    layer = model.get_base_model().model.layers[0]
    if op == "mlp":
        return layer.mlp, lambda x: [layer.mlp(x)]
    projections = [getattr(layer.self_attn, n) for n in QKV_PROJECTIONS]
    return nn.ModuleList(projections), lambda x: [p(x) for p in projections]


def _outputs_and_grads(model: nn.Module, op: str, x: torch.Tensor) -> list[torch.Tensor]:
    module, run = _op(model, op)
    outputs = run(x)  # type: ignore[operator]
    weights = [torch.linspace(-1, 1, o.shape[-1], dtype=torch.float64) for o in outputs]
    loss = sum((o.double() * w).sum() for o, w in zip(outputs, weights, strict=True))
    params = [p for n, p in module.named_parameters() if "lora_" in n]
    return [o.detach().double() for o in outputs] + [g.double() for g in torch.autograd.grad(loss, params)]


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("op", ["mlp", "qkv"])
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
def test_fused_nodes_run_in_bf16_under_autocast_within_the_table(op, stored) -> None:
    """The SwiGLU and q/k/v nodes run fused under autocast (bf16 or fp32-stored base): outputs
    within :data:`OP_TOLERANCE` of float64 on the same (bf16-rounded) weights, and no worse than
    PEFT's own layers under the same autocast."""
    base = _in_bf16(tiny_peft()) if stored == torch.bfloat16 else tiny_peft()
    fused, peft = copy.deepcopy(base), copy.deepcopy(base)
    assert fuse_lora(fused).mlps == 2
    exact = copy.deepcopy(base).double()
    x = torch.randn(3, 11, 32, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _outputs_and_grads(fused, op, x)
        theirs = _outputs_and_grads(peft, op, x)
        _, run = _op(fused, op)
        node = run(x)[0].grad_fn  # type: ignore[operator]
    assert "LoRA" in type(node.next_functions[0][0]).__name__  # the fused node ran, not PEFT's path
    expected = _outputs_and_grads(exact, op, x.double())
    outputs = len(ours) - sum(1 for n, _ in _op(fused, op)[0].named_parameters() if "lora_" in n)
    for i, (a, b, e) in enumerate(zip(ours, theirs, expected, strict=True)):
        kind = "output" if i < outputs else "gradient"
        assert ours[i].dtype == torch.float64
        error, peft_error = _relative(a, e), _relative(b, e)
        assert error <= OP_TOLERANCE[kind], (op, kind, i, error)
        assert error <= OWN_FACTOR * peft_error + 2e-3, (op, kind, i, error, peft_error)


def test_the_build_check_runs_in_bf16_for_a_bf16_base() -> None:
    """On a bf16 base the check runs under bf16 autocast: right rewrites pass its bf16 bound, a
    layer whose fused form differs from its forward is still caught."""
    assert fuse_lora(_in_bf16(tiny_peft())).left_unfused == []
    model = _in_bf16(tiny_peft())
    layer = model.get_base_model().model.layers[0]
    layer.mlp = NotSwiGLU(layer.mlp)
    with pytest.warns(UserWarning, match="fused LoRA left 1 layers"):
        assert fuse_lora(model).left_unfused == ["base_model.model.model.layers.0.mlp"]


# -- every family: bf16 vs fp32 -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_familys_bf16_loss_and_gradients_stay_near_fp32(name, tmp_path) -> None:
    path = build_family(name, VOCAB, tmp_path / name)
    lora = LoRAConfig(r=4, alpha=8)
    full = InstructLoRAModule(model=str(path), lora=lora)
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero B: both LoRA factors get gradients
        for param_name, p in full.named_parameters():
            if "lora_B" in param_name:
                p.normal_(0.0, 0.05)
    ours = InstructLoRAModule(model=str(path), lora=lora, dtype="bfloat16")
    own = InstructLoRAModule(model=str(path), lora=lora, dtype="bfloat16", fuse_lora=False, loss="reference")
    ours.load_state_dict(full.state_dict())
    own.load_state_dict(full.state_dict())
    assert ours.lm_head.weight.dtype == torch.bfloat16
    batch = PadCollator(0)(samples())
    expected = own_loss(full, batch)
    expected_grads = lora_grads(full, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, own_bf16 = our_loss(ours, batch), own_loss(own, batch)
    grads, own_grads = lora_grads(ours, loss), lora_grads(own, own_bf16)
    assert abs(float(loss) - float(expected)) <= FAMILY_LOSS * abs(float(expected))

    def error(actual: dict[str, torch.Tensor]) -> float:
        return max(float((actual[k] - g).norm() / g.norm()) for k, g in expected_grads.items())

    assert all(g.dtype == torch.float32 for g in grads.values())
    bound = FAMILY_GRADIENT_WIDER.get(name, FAMILY_GRADIENT)
    assert error(grads) <= bound, (name, error(grads))
    assert error(grads) <= OWN_FACTOR * error(own_grads) + 1e-2, (name, error(grads), error(own_grads))
