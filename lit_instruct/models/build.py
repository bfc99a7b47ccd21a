"""The one path from a model name to a trainable model: load the base, check its output head, build
it for packed rows, attach LoRA, fuse the adapters, and put the 4-bit layers back in training layout;
for ``lora.init: eva``, a second stage fed by the training data (:func:`finish_eva`) sets the adapters
and then fuses them.

Each rewrite checks itself against the model's own forward as it is made (the head check, the
packed-vs-alone check, LoRA coverage, the fused-LoRA check), in this order: every check after the
first runs on the model the earlier steps built. A rank that builds on the meta device (FSDP's
``low_memory_load``) skips the checks that need weights; rank 0 runs them on the same model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lit_instruct.errors import ConfigError
from lit_instruct.loss.logits import LogitTransform
from lit_instruct.model_names import resolve_model_path
from lit_instruct.models.decoder import decoder_of
from lit_instruct.models.eva_init import EvaResult, apply_eva_ranks, eva_data_pass
from lit_instruct.models.four_bit import check_training_layout
from lit_instruct.models.fused_lora import FusedLayers, fuse_lora
from lit_instruct.models.load import AttnImplementation, DType, QuantizationConfig, load_base_model
from lit_instruct.models.lora import LoRAConfig, attach_lora, load_lora
from lit_instruct.models.moe import RouterAuxLoss
from lit_instruct.models.neftune import add_embedding_noise
from lit_instruct.models.new_tokens import grow_embeddings, trainable_token_indices
from lit_instruct.models.output_head import output_head
from lit_instruct.models.packing import enable_packing
from lit_instruct.models.residual_init import initial_adapter, is_residual_init, loftq_initialise
from lit_instruct.rules import check_values, flatten, refuse_conflicts
from lit_instruct.vocabulary import base_tokenizer

logger = logging.getLogger("lit_instruct")


@dataclass(kw_only=True)
class ModelOptions:
    """How to build the trainable model (:class:`~lit_instruct.train.module.InstructLoRAModule`'s
    model arguments)."""

    model: str = "smollm2-135m-instruct"
    dtype: DType = "float32"
    trust_remote_code: bool = False
    attn_implementation: AttnImplementation = "auto"
    packing: bool = False
    fuse_lora: bool = True
    gradient_checkpointing: bool = False
    checkpoint_layers: int | None = None
    compile_layers: bool = False
    adapter: str | None = None
    """A PEFT adapter folder to start from (its own LoRA settings) instead of fresh adapters."""
    added_tokens: list[str] | None = None
    """Tokens added to the vocabulary (the data's ``new_tokens``): embedding rows grown for them and
    trained (peft's ``trainable_token_indices``, unless ``lora.modules_to_save`` trains the modules whole)."""
    neftune_noise_alpha: float | None = None
    """NEFTune's noise scale on the input embeddings in training mode (:mod:`lit_instruct.models.neftune`)."""


@dataclass
class TrainableModel:
    """A peft model ready to train, and what the loss needs to know of its base."""

    peft_model: Any
    logit_transform: LogitTransform
    """The model's own logit scaling / soft-capping, checked against its logits."""
    router_aux_loss: RouterAuxLoss | None
    """The router's auxiliary loss, for MoE models whose forward adds it."""
    fused_layers: FusedLayers | None
    built_on_meta: bool
    """Built without weights (a rank that receives its shards from rank 0)."""
    initial_adapter: dict[str, torch.Tensor] | None = None
    """A residual init's (PiSSA, OLoRA) adapter weights at init: the saved adapter is converted with them."""


def check_model_settings(
    options: ModelOptions, lora: LoRAConfig, quantization: QuantizationConfig, low_memory_load: bool = False
) -> None:
    """Refuse values and pairs of model settings that cannot work (:mod:`lit_instruct.rules`), before
    any weights are read."""
    model = {**asdict(options), "lora": asdict(lora), "quantization": asdict(quantization)}
    settings = flatten({"model": {**model, "low_memory_load": low_memory_load}})
    check_values(settings)
    refuse_conflicts(settings)


def trainable_in_fp32(model: torch.nn.Module) -> None:
    """Every trained weight in fp32 whatever the base's dtype: peft keeps LoRA factors fp32 over a
    bf16 base, but new tokens' rows and ``modules_to_save`` copies come in the base's dtype, where
    Adam's small updates would round away. Their forward casts them to the base's dtype as it runs."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype in (torch.bfloat16, torch.float16):
            parameter.data = parameter.data.float()


def build_trainable_model(
    options: ModelOptions,
    lora: LoRAConfig,
    quantization: QuantizationConfig,
    low_memory_ranks: bool = False,
    on_meta: bool = False,
) -> TrainableModel:
    """Build the trainable model for ``options``.

    ``low_memory_ranks``: some ranks build on the meta device (every rank then skips the probe
    forward of LoRA targeting, so that all place the same adapters); ``on_meta``: this one does.

    Raises:
        UnsupportedModelError: a head, packing or fused-LoRA check failed (named in the message).
        ConfigError: a setting's value or a pair of settings that cannot work (before any weights
            are read).
        ValueError: a LoRA shortfall.
    """
    check_model_settings(options, lora, quantization, low_memory_ranks)
    residual = is_residual_init(lora.init)
    base: Any = load_base_model(
        options.model,
        options.dtype,
        options.trust_remote_code,
        quantization,
        options.attn_implementation,
        on_meta,
    )
    token_ids: list[int] = []
    if options.added_tokens:
        if low_memory_ranks:
            raise ConfigError(
                "model.added_tokens",
                f"{options.added_tokens} (data.new_tokens) with model.low_memory_load is not supported yet",
            )
        tokenizer = base_tokenizer(options.model, options.added_tokens)
        token_ids = tokenizer.convert_tokens_to_ids(options.added_tokens)
        grow_embeddings(base, token_ids)
    if options.packing:
        enable_packing(base, check=not on_meta)  # rank 0 checks the same model with its weights
    transform = output_head(base, verify=not on_meta).transform  # rank 0 verifies it
    router_aux_loss = RouterAuxLoss.of(base)
    if options.adapter is not None:
        peft_model = load_lora(base, options.adapter)
    else:
        trainable = trainable_token_indices(base, token_ids) if token_ids else None
        peft_model = attach_lora(base, lora, not low_memory_ranks, trainable)  # the same on every rank
    peft_model.train()  # from_pretrained leaves the base in eval mode; LoRA dropout must be live
    trainable_in_fp32(peft_model)
    initial = initial_adapter(peft_model) if residual else None
    fuse_now = options.fuse_lora and lora.init != "eva"  # EVA's data pass hooks peft's own layers first
    fused = fuse_lora(peft_model, check=not on_meta) if fuse_now else None
    if fused is not None and lora.use_dora:
        logger.info("fused LoRA: the DoRA layers run peft's own forward (their fused form is not written)")
    if quantization.method != "none":  # the build checks above ran eval forwards on it
        check_training_layout(peft_model, getattr(torch, quantization.compute_dtype))
    if lora.init == "loftq":  # on the training layout: it dequantizes the 4-bit weights
        loftq_initialise(peft_model, resolve_model_path(options.model))
    if options.gradient_checkpointing:  # non-reentrant: works with a frozen embedding, no input-grad hooks
        base.gradient_checkpointing_enable({"use_reentrant": False})
        if options.checkpoint_layers is not None:
            for layer in decoder_of(base).layers[options.checkpoint_layers :]:
                layer.gradient_checkpointing = False
    if options.compile_layers:
        for layer in decoder_of(base).layers:
            layer.compile(dynamic=True)
    if options.neftune_noise_alpha is not None:
        add_embedding_noise(peft_model, options.neftune_noise_alpha)
    return TrainableModel(peft_model, transform, router_aux_loss, fused, on_meta, initial)


@dataclass
class EvaStage:
    """What the data-fed stage gave: every adapted layer's rank, the data pass (``None`` when a
    checkpoint's ranks were rebuilt instead), and the fused LoRA layers."""

    ranks: dict[str, int]
    data_pass: EvaResult | None
    fused_layers: FusedLayers | None


def finish_eva(
    peft_model: Any,
    fuse: bool,
    *,
    ranks: dict[str, int] | None = None,
    loader: Iterable[dict[str, Any]] | None = None,
    trunk: Callable[[dict], Any] | None = None,
) -> EvaStage:
    """The build's second stage for ``lora.init: eva``, once training data is at hand: EVA's data pass
    over ``loader`` through ``trunk`` (or a checkpoint's ``ranks`` rebuilt, no pass: its weights replace
    the adapters), then what the first stage deferred: trained weights in fp32 (EVA's come in the base's
    dtype) and, with ``fuse``, the fused LoRA layers. Runs before the optimizer exists: ranks change."""
    data_pass = None
    if ranks is not None:
        apply_eva_ranks(peft_model, ranks)
    elif loader is not None and trunk is not None:
        data_pass = eva_data_pass(peft_model, loader, trunk)
        ranks = data_pass.ranks
    else:
        raise ValueError("finish_eva needs a checkpoint's ranks, or a loader and a trunk for the data pass")
    trainable_in_fp32(peft_model)
    return EvaStage(dict(ranks), data_pass, fuse_lora(peft_model) if fuse else None)
