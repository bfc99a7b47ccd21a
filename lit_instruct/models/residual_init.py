"""PiSSA and OLoRA: adapters initialised from the base weights, which are replaced by the residual.

At init peft sets ``A0, B0`` from the weight (PiSSA: its top singular vectors, ``pissa_niter_N`` by
randomized SVD; OLoRA: its QR decomposition) and the base weight becomes ``W - s * B0 @ A0``. The
trained ``B @ A`` therefore fits only that residual base. Two consequences, both handled here:

* Checkpoints keep the adapter weights only; resuming rebuilds the model, and with it the same
  residual and ``A0, B0`` (the decompositions are deterministic, ``pissa_niter_N`` under the run's seed).
* The adapter written for users is converted to plain LoRA on the *original* base, as peft's
  ``save_pretrained(path_initial_model_for_weight_conversion=...)`` does: ``s * (B @ A - B0 @ A0) =
  s * [B | -B0] @ [A ; A0]``, rank ``2r`` with alpha doubled (``x sqrt(2)`` with rsLoRA) so that the
  scale stays ``s``. Merge, GGUF, generation and continuing all read it as any LoRA adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lit_instruct.adapter_folder import adapter_tensors
from lit_instruct.rules import is_residual_init

__all__ = ["as_plain_lora", "initial_adapter", "is_residual_init", "loftq_initialise"]


def initial_adapter(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter weights right after a residual init (``A0, B0``), under their saved names."""
    return {k: v.detach().clone() for k, v in adapter_tensors(peft_model).items()}


def as_plain_lora(folder: Path, initial: dict[str, torch.Tensor]) -> None:
    """Rewrite the adapter saved in ``folder`` (trained from a residual init whose weights were
    ``initial``) as plain LoRA on the original base (see the module's docstring)."""
    from lit_instruct.adapter_folder import read_config, read_weights, write_config, write_weights

    trained = read_weights(folder)
    converted = {}
    for name, tensor in trained.items():
        if ".lora_A." in name:
            converted[name] = torch.cat([tensor, initial[name].to(tensor)], dim=0)
        elif ".lora_B." in name:
            converted[name] = torch.cat([tensor, -initial[name].to(tensor)], dim=1)
        else:
            converted[name] = tensor
    config = read_config(folder)
    config["r"] *= 2
    config["lora_alpha"] *= 2**0.5 if config.get("use_rslora") else 2
    config["rank_pattern"] = {key: 2 * rank for key, rank in (config.get("rank_pattern") or {}).items()}
    config["alpha_pattern"] = {key: 2 * alpha for key, alpha in (config.get("alpha_pattern") or {}).items()}
    config["init_lora_weights"] = True
    write_weights(folder, converted)
    write_config(folder, config)


def loftq_initialise(peft_model: Any, model_folder: str) -> None:
    """LoftQ on an NF4 base: each adapter set so that ``NF4(W) + s * B @ A`` is closest to the
    full-precision ``W`` (read from ``model_folder``'s safetensors): ``s * B @ A`` the best rank-r
    approximation of the quantization error ``W - NF4(W)`` (one step, as peft's
    ``replace_lora_weights_loftq``, which runs on CUDA only; here the scale ``s`` is divided out, so the
    approximation holds for any alpha). The base stays quantized; the adapter is plain LoRA for it."""
    from bitsandbytes.functional import dequantize_4bit
    from peft.tuners.lora import Linear4bit
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for path in Path(model_folder).glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            files |= dict.fromkeys(handle.keys(), path)
    for name, module in peft_model.named_modules():
        if not isinstance(module, Linear4bit):
            continue
        key = name.removeprefix("base_model.model.") + ".weight"
        if key not in files:
            raise ValueError(f"model.lora.init: loftq needs {key} in {model_folder}'s safetensors files")
        with safe_open(str(files[key]), "pt") as handle:
            full = handle.get_tensor(key).float()
        quantized = dequantize_4bit(module.weight.data, module.weight.quant_state).float()
        u, s, vh = torch.linalg.svd(full - quantized.to(full.device), full_matrices=False)
        r, scale = module.r["default"], module.scaling["default"]
        root = (s[:r] / scale).sqrt()
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        a.data = (root[:, None] * vh[:r]).to(a)
        b.data = (u[:, :r] * root).to(b)
