"""InstructLoRAModule: LoRA fine-tuning of a causal LM with the loss on response tokens only."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lit_instruct.adapter_folder import save_adapter
from lit_instruct.batch import num_tokens, prompt_rows
from lit_instruct.distributed import full_tensor, is_sharded, launched_rank
from lit_instruct.errors import ConfigError
from lit_instruct.io import check_replaceable, log_dir
from lit_instruct.loss.contract import LossFn
from lit_instruct.loss.preference import PreferenceConfig
from lit_instruct.loss.table import LossChoice, resolve_loss
from lit_instruct.model_card import TrainingCard
from lit_instruct.models.build import (
    EvaStage,
    ModelOptions,
    build_trainable_model,
    finish_eva,
)
from lit_instruct.models.decoder import decoder_of, parts_outside_decoder
from lit_instruct.models.eva_init import EvaResult
from lit_instruct.models.generation import generate
from lit_instruct.models.load import AttnImplementation, DType, QuantizationConfig
from lit_instruct.models.lora import LoRAConfig, lora_config_of, with_adapter_structure
from lit_instruct.models.merged_sampling import merged_adapters
from lit_instruct.models.residual_init import as_plain_lora
from lit_instruct.objectives import Objective, ObjectiveName, ObjectiveSums, PairObjective, resolve_objective
from lit_instruct.precision import AUTO, auto_precision, is_bf16
from lit_instruct.rng import gather_states
from lit_instruct.train.fit_report import FitReport
from lit_instruct.train.fsdp import (
    average_replicated_gradients,
    broadcast_whole,
    fill_from_rank_zero,
    gathered_trainable_state,
    shard_model,
    sharding_mesh,
    whole_tied_head,
)
from lit_instruct.train.nonfinite import SkipNonFiniteSteps
from lit_instruct.train.progress_bar import readable_bar
from lit_instruct.train.reference import reference_pass, trainable_copy
from lit_instruct.train.resume import resumed_entry
from lit_instruct.train.rng_states import RestoreRNGStates
from lit_instruct.train.threads import ThreadBudget
from lit_instruct.train.throughput import TokensPerSecond
from lit_instruct.train.validation_sums import ValidationSums
from lit_instruct.train.window import StepWindow, gradient_factor, scale_gradients
from lit_instruct.vocabulary import base_tokenizer


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Any:
    """LR multiplier: linear warmup from ~0 to 1, then cosine decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


LOSS_ON = {
    "conversations": "response tokens only",
    "pairs": "preference pairs",
    "unpaired": "answers labelled desirable or not",
}
"""What the model card says the loss was computed on, by the objective's batch kind."""

EVA_RANKS_KEY = "eva_ranks"
"""Checkpoint entry of the ranks EVA's data pass gave each adapted layer (a resume rebuilds with them)."""
OBJECTIVE_STATE_KEY = "objective_state"
"""Checkpoint entry of every rank's objective state (a rollout the steps after the checkpoint reuse)."""


def check_eva_ranks(saved: dict[str, int] | None, built: dict[str, int] | None) -> None:
    """Refuse a checkpoint whose EVA ranks are not those the adapters were built with."""
    if saved is not None and built is not None and saved != built:
        differ = sorted(name for name in saved.keys() | built.keys() if saved.get(name) != built.get(name))
        raise ValueError(
            f"the checkpoint's EVA ranks differ from this model's at {len(differ)} layers ({differ[:3]}): "
            "resume it with trainer.fit(..., ckpt_path=...), which rebuilds the adapters with its ranks"
        )


def loraplus_groups(model: nn.Module) -> list[dict[str, Any]]:
    """LoRA+'s two parameter groups, as peft's ``create_loraplus_optimizer`` forms them: A matrices,
    then B matrices with the 1-D adapter weights (DoRA's magnitudes)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    fast = [p for name, p in named if "lora_B" in name or p.ndim == 1]
    slow = [p for name, p in named if not ("lora_B" in name or p.ndim == 1)]
    return [{"params": slow}, {"params": fast}]


def adamw(
    params: list[nn.Parameter] | list[dict[str, Any]],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> torch.optim.AdamW:
    """AdamW over all adapter tensors at once (``foreach``): PyTorch's default loops over the
    tensors one by one (hundreds of adapter tensors; measured in docs/benchmarks.md)."""
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=True)


def placement_parts(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` as the sharded ones and the whole ones (each list only where not empty), in order."""
    sharded = [p for p in params if is_sharded(p)]
    whole = [p for p in params if not is_sharded(p)]
    return [part for part in (sharded, whole) if part]


class InstructLoRAModule(L.LightningModule):
    """A causal LM with LoRA adapters, trained on what its *objective* says.

    The objective (:mod:`lit_instruct.objectives`) turns a batch into its summed loss, the count that
    sum is normalized by and its metrics; the module does the rest, for every objective: the build,
    one window that divides the step's gradient by the count of the whole accumulation window on all
    ranks, one validation, the optimizer, checkpoints and the adapter. SFT (the default) runs the
    decoder trunk to final hidden states and hands them, shifted, to
    ``self.loss_fn(hidden, lm_head.weight, labels, bias=..., transform=...)`` with the model's own
    logit scaling / soft-capping (read from its forward and checked against its logits at load); the
    full ``[tokens, vocab]`` logits are never asked for (``loss``: the fused loss by default). MoE
    models whose forward adds the router's auxiliary loss get it added too, for every objective.

    The module brings its own callbacks (:meth:`configure_callbacks`): ``train/tokens_per_s``, RNG
    states in checkpoints for exact resumes, and the fit report.

    Args:
        model: bundled name (``smollm2-135m-instruct``), local folder, or hub id.
        objective: what is trained: ``sft`` (default), ``dpo``, ``ipo``, ``simpo``, ``orpo``, or
            ``{class_path: ..., init_args: ...}`` (a short name, a class name or the import path of
            an :class:`~lit_instruct.objectives.Objective` subclass, a user's own too), or an
            objective object. Its batch kind must be the data's (the CLI links them).
        preference: the old form of a pair objective (``kind``, ``beta``...): still read, and said
            how to write as ``objective``.
        dtype: dtype of the frozen base weights; ``auto``: ``bfloat16`` where the device computes
            bf16 natively (:func:`lit_instruct.precision.auto_precision`, the Trainer's
            ``precision="auto"``), else ``float32``; a bf16 base under an fp32 Trainer precision is
            upcast at setup. The LoRA weights, their gradients and the optimizer state stay fp32.
        lora: LoRA adapter settings.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay on adapter weights.
        betas: AdamW betas.
        warmup_steps: linear warmup steps before the cosine decay.
        min_lr_ratio: final learning rate as a fraction of the peak.
        adapter_dir: where the PEFT adapter is written at the end of fit (default: ``<log dir>/adapter``).
        trust_remote_code: let ``transformers`` run code shipped with the model (off: it is untrusted).
        quantization: 4-bit base weights (QLoRA): ``method: nf4`` or ``fp4``, ``double_quant``,
            ``compute_dtype``; ``dtype`` is then ignored.
        gradient_checkpointing: recompute each decoder layer's activations in backward instead of
            keeping them (less memory, about a third more compute).
        checkpoint_layers: with ``gradient_checkpointing``, recompute only the first this many
            decoder layers (``None``: all): activation memory and speed in between.
        compile_layers: ``torch.compile`` each decoder layer (dynamic shapes): faster steps after
            a compilation of a minute or more.
        attn_implementation: ``auto`` (what ``transformers`` picks for the family: SDPA, or eager
            where SDPA cannot do the family's attention; SDPA runs as batched GEMMs on CPU in bf16
            where that is faster, :mod:`lit_instruct.models.gemm_attention`), ``sdpa`` (PyTorch's
            kernel always), ``eager``, or another ``transformers`` implementation (packed batches
            need ``sdpa`` or ``eager``).
        packing: build the model for packed rows (``data.packing``; the CLI links the two): its
            attention runs sample by sample, after a check at build time that a packed row gives
            what its samples give alone (:func:`lit_instruct.models.packing.enable_packing`).
        low_memory_load: with ``fsdp_lora``, only rank 0 reads the base's weights; the other
            ranks build it on the meta device and receive their shards from rank 0 when it is
            sharded, so no other rank ever holds the whole base (a 4-bit base still loads on every
            rank: it is quantized from its weights).
        loss: ``fused`` (default: :class:`~lit_instruct.loss.FusedLinearCrossEntropy`),
            ``reference`` (full logits, then PyTorch's cross-entropy), or any callable with the loss
            signature (``class_path`` in YAML: Liger's or Cut Cross-Entropy's behind a small adapter,
            or ``FusedLinearCrossEntropy`` with its ``chunk_size`` / ``backend``).
        optimizer: the optimizer over the adapter weights, as LightningCLI configures one
            (``{class_path: torch.optim.SGD, init_args: {lr: 0.05}}``); its learning rate is the
            peak of the warmup-cosine schedule, and ``learning_rate``, ``betas`` and
            ``weight_decay`` are then unused. Default: AdamW with those.
        fuse_lora: run the adapters of projections that share an input (q/k/v, gate/up) and SwiGLU
            MLPs as fused autograd nodes (:mod:`lit_instruct.models.fused_lora`): the same adapters and
            results, fewer and smaller ops and saved activations; checked against PEFT's own
            forward at build time.
        adapter: a PEFT adapter folder (ours or anyone's) to continue training from: its own LoRA
            structure (rank, alpha, targets, variant), every tensor loaded into a layer of the same
            shape (an adapter of another base is an error); ``lora``'s structural fields are left
            unset or must agree, its ``loraplus_lr_ratio`` applies.
        neftune_noise_alpha: NEFTune: uniform noise of scale ``alpha / sqrt(length * hidden)`` added to
            the input embeddings in training steps only (never in validation or generation), as
            ``transformers``' own hook adds it for TRL's ``SFTTrainer``; ``None``: off.
        added_tokens: tokens added to the vocabulary, in the data's order (the CLI links
            ``data.new_tokens``' resolved list): the embedding (and an untied head) grows rows for
            them, at the mean of the others, and those rows train (``lora.modules_to_save`` trains
            the modules whole); the adapter folder then carries the grown tokenizer.
    """

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        dtype: DType | Literal["auto"] = "float32",
        lora: LoRAConfig | dict[str, Any] | None = None,
        learning_rate: float = 2e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        adapter_dir: str | None = None,
        trust_remote_code: bool = False,
        quantization: QuantizationConfig | dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        checkpoint_layers: int | None = None,
        compile_layers: bool = False,
        attn_implementation: AttnImplementation = "auto",
        packing: bool = False,
        low_memory_load: bool = False,
        fuse_lora: bool = True,
        loss: LossChoice | Callable = "fused",  # Callable, not LossFn: jsonargparse then builds a class_path
        optimizer: OptimizerCallable | None = None,
        adapter: str | None = None,
        added_tokens: list[str] | None = None,
        neftune_noise_alpha: float | None = None,
        objective: Objective | ObjectiveName | None = None,
        preference: PreferenceConfig | None = None,
    ) -> None:
        super().__init__()
        self.objective = resolve_objective(objective, preference)  # checked before the model loads
        given = {"packing": packing, "neftune_noise_alpha": neftune_noise_alpha, "loss": loss}
        self.objective.check(given)  # the names of preflight.OBJECTIVE_CHECKED
        self.lora_config = LoRAConfig(**lora) if isinstance(lora, dict) else lora or LoRAConfig()
        if adapter is not None:  # the adapter brings its own structure; LoRA+ is the user's to set
            self.lora_config = with_adapter_structure(self.lora_config, lora_config_of(adapter))
        if isinstance(quantization, dict):
            quantization = QuantizationConfig(**quantization)
        self.quantization = quantization or QuantizationConfig()
        self.save_hyperparameters(
            ignore=["lora", "quantization", "loss", "optimizer", "objective", "preference"]
        )
        self.hparams["objective"] = self.objective.config()  # plain data: what rebuilds it
        # hparams rebuild the module (checkpoints): a loss given by name is kept, objects are not
        self.hparams["loss"] = loss if isinstance(loss, str) else None
        self.optimizer_factory = optimizer
        self.hparams["lora"] = asdict(self.lora_config)  # plain data in checkpoints
        self.hparams["quantization"] = asdict(self.quantization)
        self.dtype_chosen = dtype == AUTO  # by the hardware: undone at setup under an fp32 Trainer
        options = ModelOptions(
            model=model,
            dtype=auto_precision().dtype if dtype == AUTO else dtype,  # type: ignore[arg-type]
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            packing=packing,
            fuse_lora=fuse_lora,
            gradient_checkpointing=gradient_checkpointing,
            checkpoint_layers=checkpoint_layers,
            compile_layers=compile_layers,
            adapter=adapter,
            added_tokens=added_tokens or None,
            neftune_noise_alpha=neftune_noise_alpha,
        )
        meta_ranks = low_memory_load and self.quantization.method == "none"
        built = build_trainable_model(
            options, self.lora_config, self.quantization, meta_ranks, meta_ranks and launched_rank() > 0
        )
        self.model = built.peft_model
        self.logit_transform = built.logit_transform
        self.router_aux_loss = built.router_aux_loss
        self.fused_layers = built.fused_layers
        self.built_on_meta = built.built_on_meta
        self.initial_adapter = built.initial_adapter
        self.eva_pending = self.lora_config.init == "eva" and adapter is None
        self.eva_ranks: dict[str, int] | None = None  # the ranks EVA gave (checkpoints keep them)
        self.eva_result: EvaResult | None = None  # this fit's data pass (none when resumed with ranks)
        self.packing = packing
        self.loss_fn: LossFn = resolve_loss(loss)
        self.window = StepWindow(self.objective.metric_names)
        self.val_sums = ValidationSums(self.objective.metric_names)
        self.reference_adapter: dict[str, torch.Tensor] | None = None  # the SFT adapter, as the reference
        if adapter is not None and self.objective.needs_reference:
            self.reference_adapter = trainable_copy(self.model)  # before a checkpoint's weights load
        self.tokens_seen = 0
        self.response_tokens_seen = 0
        self.last_val_step: int | None = None
        self.saved_adapter: Path | None = None
        self.chat_template: str | None = None  # the data's, once a datamodule that renders is attached
        self._sharded = False
        self._vision_use_pending = True  # until a batch with images has shown which adapters it reaches
        self._images_in_batch = False

    # -- the model ------------------------------------------------------------------------------

    @property
    def base_model(self) -> Any:
        """The wrapped ``transformers`` model (LoRA layers injected in place; its attributes vary by
        family, hence ``Any``)."""
        return self.model.get_base_model()

    @property
    def lm_head(self) -> nn.Linear:  # output_head() checked it is one
        """The output projection whose weight the loss takes."""
        return self.base_model.get_output_embeddings()

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        kind = getattr(datamodule, "batch_kind", None)
        if kind is not None and kind != self.objective.batch_kind:
            name = self.objective.name or type(self.objective).__name__
            raise ConfigError(
                "data.batch_kind",
                f"{kind!r} cannot be combined with model.objective: {name}, which takes "
                f"{self.objective.batch_kind}: pass InstructDataModule(batch_kind="
                f"{self.objective.batch_kind!r}) (the CLI links it)",
            )
        if getattr(datamodule, "packing", False) and not self.packing:
            raise ValueError(
                "data.packing is on but the model was built without packing: pass "
                "InstructLoRAModule(packing=True) (the CLI links data.packing to model.packing)"
            )
        if stage == "fit":
            self._check_adapter_folder()
            self._find_unused_under_ddp()
        if self.dtype_chosen:
            self._match_trainer_precision()
        if self.eva_pending and stage == "fit":
            self._eva_from_checkpoint_or_data(datamodule)  # from the batches as the data gives them
        repeat_windows = getattr(datamodule, "repeat_windows", None)
        if stage == "fit" and callable(repeat_windows):
            repeat_windows(self.objective.window_repeats)  # online RL: each rollout trains N steps
        template_of = getattr(datamodule, "training_chat_template", None)
        if callable(template_of):
            self.chat_template = template_of()
        new_token_list = getattr(datamodule, "new_token_list", None)
        added = new_token_list() if callable(new_token_list) else None
        if added is not None and added != (self.hparams.get("added_tokens") or []):
            raise ValueError(
                f"the data adds the tokens {added} to the vocabulary but the model was built with "
                f"added_tokens={self.hparams.get('added_tokens')}: pass InstructLoRAModule(added_tokens="
                "datamodule.new_token_list()) (the CLI links them)"
            )

    def _check_adapter_folder(self) -> None:
        """The folder the adapter will replace holds nothing but an adapter of ours, and not this
        run's own log folder: refused before training, not after it."""
        target, run = self.adapter_path().resolve(), log_dir(self.trainer).resolve()
        if target == run or target in run.parents:
            raise ConfigError(
                "model.adapter_dir",
                f"{str(self.hparams['adapter_dir'])!r} holds this run's log folder {str(run)!r} "
                "(checkpoints, metrics), which writing the adapter would delete; name a folder of its own",
            )
        check_replaceable(target, "model.adapter_dir")

    def _match_trainer_precision(self) -> None:
        """``dtype: auto`` chose bf16 base weights for this hardware, but the Trainer computes in
        fp32: the base's floating weights go back to fp32 (what that precision asks for)."""
        precision = str(self.trainer.precision)
        low = [p for p in self.model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
        if is_bf16(precision) or precision.startswith("16") or not low:
            return
        for parameter in low:
            parameter.data = parameter.data.float()
        rank_zero_info(f"lit-instruct: model.dtype auto: base weights float32 under precision {precision}")
        self.dtype_chosen = False

    def _eva_from_checkpoint_or_data(self, datamodule: Any) -> None:
        """``lora.init: eva``: the build's data-fed stage, before the optimizer exists (the ranks may
        change). A fit resumed from a checkpoint that records EVA ranks rebuilds them with those (no data
        pass: the checkpoint's weights replace the adapters); otherwise from the training batches, on
        the training device."""
        ranks = resumed_entry(self.trainer, EVA_RANKS_KEY)
        if ranks is not None:
            self._eva_finished(finish_eva(self.model, self.hparams["fuse_lora"], ranks=ranks))
            return
        if datamodule is None or not hasattr(datamodule, "train_dataloader"):
            raise ValueError("model.lora.init: eva needs a datamodule: its training batches set the adapters")
        self.model.to(self.trainer.strategy.root_device)  # peft moves each batch to the model's device
        loader = datamodule.train_dataloader()
        if self.objective.batch_kind == "prompts":  # the prompts as rows: the inputs the policy sees
            loader = map(prompt_rows, loader)
        self.initialise_eva(loader)

    def initialise_eva(self, loader: Iterable[dict[str, Any]]) -> EvaResult:
        """Set the adapters of a ``lora.init: eva`` model from the first batches of ``loader`` (peft's
        EVA through the trunk; :data:`~lit_instruct.models.eva_init.EVA_BATCHES` at most), then fuse
        the LoRA layers."""
        stage = finish_eva(self.model, self.hparams["fuse_lora"], loader=loader, trunk=self.trunk)
        self._eva_finished(stage)
        assert stage.data_pass is not None  # a loader was given
        return stage.data_pass

    def _eva_finished(self, stage: EvaStage) -> None:
        self.eva_ranks, self.eva_result = stage.ranks, stage.data_pass
        if stage.fused_layers is not None:
            self.fused_layers = stage.fused_layers
        self.eva_pending = False

    @functools.cached_property
    def multimodal(self) -> bool:
        """Whether the base is a vision-language model (parts outside its decoder)."""
        return bool(parts_outside_decoder(self.base_model))

    def trainable_outside_decoder(self) -> dict[str, nn.Parameter]:
        """Trainable weights of a vision-language model's vision tower and projector
        (``model.lora.vision``), which only batches with images reach, by name in the base."""
        return {
            name: p
            for part in parts_outside_decoder(self.base_model)
            for name, p in self.base_model.get_submodule(part).named_parameters(prefix=part)
            if p.requires_grad
        }

    def _find_unused_under_ddp(self) -> None:
        """Under DDP, weights only batches with images reach are unused on a rank whose batch has
        none: DDP must look for unused weights each step, or it waits for their gradients forever.

        Raises:
            ConfigError: a DDP strategy set not to look (``find_unused_parameters: false``).
        """
        from lightning.pytorch.strategies import DDPStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, DDPStrategy) or not self.trainable_outside_decoder():
            return
        settings = strategy._ddp_kwargs  # Lightning's DDP settings, read when it wraps the model after setup
        if settings.setdefault("find_unused_parameters", True) is not True:
            raise ConfigError(
                "trainer.strategy",
                "DDP with find_unused_parameters false cannot train model.lora.vision: the vision "
                "adapters get no gradient on a rank whose batch has no image (set it true or unset)",
            )

    def configure_model(self) -> None:
        """Under a strategy with a device mesh (``fsdp_lora``, Lightning's ``ModelParallelStrategy``):
        shard the base per decoder layer, at the trunk and at the lm_head with FSDP2
        (:mod:`lit_instruct.train.fsdp`); with ``low_memory_load``, fill the shards from rank 0. Other
        strategies leave the model as built."""
        mesh = self.device_mesh
        if mesh is None:
            if self.hparams.get("low_memory_load"):
                raise ConfigError("model.low_memory_load", "true needs trainer.strategy: fsdp_lora")
            return
        if self._sharded:
            return
        if self.multimodal and self.packing:  # packed batches run the decoder alone, outside the core
            raise ConfigError(
                "model.packing",
                "true cannot be sharded with a vision-language model under trainer.strategy: fsdp_lora "
                "(set data.packing: false, or use ddp_lora)",
            )
        low_memory = bool(self.hparams.get("low_memory_load"))
        full = dict(self.model.state_dict()) if low_memory and self.global_rank == 0 else None  # whole
        shard_model(self.base_model, sharding_mesh(mesh))
        if low_memory:
            fill_from_rank_zero(self.model, full, self.device)
        else:  # the adapters FSDP leaves whole (a vision tower's): rank 0's on every rank, as DDP does
            broadcast_whole(list(self.trainable_outside_decoder().values()))
        self._sharded = True
        if self.reference_adapter is not None:  # again, from the shards (DTensors laid out as the
            self.reference_adapter = trainable_copy(self.model)  # parameters; a checkpoint loads after)

    def configure_callbacks(self) -> list[L.Callback]:
        """Throughput, RNG states for exact resumes, the fit report, on CPU the threads following the
        cores other processes leave free, and the non-finite step guard: those of these types the
        Trainer does not hold yet (the user's own is kept, and a fit after ``validate`` keeps the ones
        attached then). Lightning's own progress bar is made readable where it stands
        (:func:`~lit_instruct.train.progress_bar.readable_bar`: no ``Epoch 0/-2``, no ``v_num``)."""
        held = self.trainer.callbacks if self._trainer is not None else []  # type: ignore[attr-defined]
        for index, callback in enumerate(held):  # in place: a bar returned here would be a second one
            held[index] = readable_bar(callback)
        ours = [TokensPerSecond(), RestoreRNGStates(), FitReport(), ThreadBudget(), SkipNonFiniteSteps()]
        return [callback for callback in ours if not any(isinstance(c, type(callback)) for c in held)]

    # -- generation -----------------------------------------------------------------------------

    predict_max_new_tokens = 256
    """How long an answer of :meth:`predict_step` may grow (set it on the module to change it)."""

    def tokenizer(self) -> Any:
        """The tokenizer of the base, with the tokens training added."""
        return base_tokenizer(self.hparams["model"], self.hparams.get("added_tokens") or [])

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        """The peft model's own forward (``transformers`` output with ``logits``)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def answer(self, prompt: str | list[dict[str, str]], max_new_tokens: int = 256, **sampling: Any) -> str:
        """Answer ``prompt`` (a user message, or chat messages) with the model as it is now, in eval
        mode (no LoRA dropout), through the chat template the data was rendered with (else the
        tokenizer's own); ``sampling``: ``temperature``, ``top_p`` (greedy by default)."""
        was_training = self.training
        self.eval()
        try:
            return generate(
                self.model,
                self.tokenizer(),
                prompt,
                max_new_tokens=max_new_tokens,
                chat_template=self.chat_template,
                **sampling,
            )
        finally:
            self.train(was_training)

    def predict_step(self, batch: list[Any], batch_idx: int = 0) -> list[str]:
        """Greedy answers to a batch of prompts (user messages, or lists of chat messages), for
        ``trainer.predict(module, dataloaders=DataLoader(prompts, batch_size=4, collate_fn=list))``."""
        return [self.answer(prompt, self.predict_max_new_tokens) for prompt in batch]

    # -- steps ----------------------------------------------------------------------------------

    def trunk(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final (normed) hidden states of the decoder, ``(B, T, H)``, and the router's auxiliary
        loss (MoE models whose forward adds it; else ``None``).

        A packed batch (:class:`~lit_instruct.data.collate.PackCollator`) has no attention mask but
        position ids and sample boundaries; its attention then runs sample by sample.
        """
        decoder = decoder_of(self.base_model)
        extra: dict[str, Any] = {}
        if "packed_segments" in batch:
            if not self.packing:
                raise ValueError("a packed batch reached a model built without packing=True")
            extra = {"position_ids": batch["position_ids"], "packed_segments": batch["packed_segments"]}
        if self.router_aux_loss is not None:
            extra["output_router_logits"] = True
        mask = batch.get("attention_mask")
        if batch.get("images") is not None and "packed_segments" in batch:
            raise ValueError("a packed batch cannot carry images (their attention is not split per sample)")
        if self.multimodal and "packed_segments" not in batch:  # the model's own path, with or without
            decoder = self.base_model.base_model  # images: one FSDP root, on every rank at every step
            extra = {**extra, **(batch.get("images") or {})}
        out = decoder(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False, **extra)
        aux = None
        if self.router_aux_loss is not None:
            aux = self.router_aux_loss(out.router_logits, mask)
        return out.last_hidden_state, aux

    def hidden_states(self, batch: dict[str, Any]) -> torch.Tensor:
        """Final (normed) hidden states of the decoder trunk, ``(B, T, H)``."""
        return self.trunk(batch)[0]

    def output_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output projection's weight and bias as the loss takes them: peft's wrappers (new
        tokens' rows, ``modules_to_save``) give what they compute with, whole if FSDP sharded them."""
        head = self.lm_head
        bias = head.bias if hasattr(head, "bias") else None  # the trainable-tokens head computes without one
        weight = full_tensor(head.weight)
        assert weight is not None
        return weight, full_tensor(bias)

    @contextmanager
    def sampling_model(self, merged: bool = False) -> Iterator[Any]:
        """The model to ``generate`` from (online objectives): the trained model, with a head tied to
        a sharded embedding whole for the while (FSDP; every rank enters); with ``merged``, its
        adapters merged into copies of their base weights (:mod:`lit_instruct.models.merged_sampling`)."""
        with (
            whole_tied_head(self.base_model) if self._sharded else nullcontext(),
            merged_adapters(self.model) if merged else nullcontext(),
        ):
            yield self.model

    @contextmanager
    def reference_model(self) -> Iterator[None]:
        """The model as an objective's reference (:mod:`lit_instruct.train.reference`): eval mode,
        and the adapter off, or the SFT adapter training continued from in place of the trained one."""
        with reference_pass(self.model, self.reference_adapter):
            yield

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over every rank (a collective; as they are without a Trainer or on one
        process)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return values
        return trainer.strategy.reduce(values, reduce_op="sum")

    def loss_sum_and_count(self, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """The objective's summed loss over ``batch`` (with the router's auxiliary loss of an MoE
        model), and the count it is normalized by (SFT: the response-token predictions)."""
        sums = self.objective_sums(batch)
        return sums.loss_sum, sums.count

    def objective_sums(self, batch: dict[str, Any]) -> ObjectiveSums:
        """The objective's sums of ``batch``; with a router auxiliary loss, ``coefficient * aux * count``
        added to the loss: divided by the count, that is the model's own ``mean loss + coefficient *
        aux`` (weighted by the count over the window)."""
        sums = self.objective.sums(self, batch)
        if sums.aux is not None and self.router_aux_loss is not None:
            if self.training:
                self.log("train/aux_loss", sums.aux.detach().float(), batch_size=1)
            sums.loss_sum = sums.loss_sum + self.router_aux_loss.coefficient * sums.aux * sums.count
        return sums

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """The micro-batch's *summed* loss; :meth:`on_before_optimizer_step` divides the window's
        gradient by the objective's count over the whole window on all ranks."""
        self._images_in_batch = batch.get("images") is not None
        sums = self.objective_sums(batch)
        self.window.add(sums.loss_sum, sums.count, num_tokens(batch), sums.answer_tokens, sums.metric_sums)
        return sums.loss_sum

    def on_after_backward(self) -> None:
        """After the first batch with images: warn of vision adapters it gave no gradient (layers the
        model computes but whose output it never uses, as LLaVA's last vision layer with
        ``vision_feature_layer: -2``), which would train nothing. The build's probe runs on text only,
        so this is where they show."""
        if not (self._vision_use_pending and self._images_in_batch):
            return
        self._vision_use_pending = False
        trained = self.trainable_outside_decoder().items()
        unused = sorted({name.rsplit(".lora_", 1)[0] for name, p in trained if p.grad is None})
        if unused:
            shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
            rank_zero_warn(
                f"model.lora.vision: {len(unused)} adapted layer(s) outside the language model got no "
                f"gradient from a batch with images ({shown}): the model computes them but does not use "
                "their output, so their adapters train nothing (lora.vision: projector leaves the tower out)"
            )

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the step's gradient that of sum(loss) / count over the whole window, all ranks, before
        any clipping (:mod:`lit_instruct.train.window`); log the window's loss, count and metrics."""
        trainer = self.trainer
        if self._sharded:  # the vision tower and projector: whole on every rank, outside FSDP
            replicated = [p for p in self.parameters() if p.requires_grad and not is_sharded(p)]
            average_replicated_gradients(replicated, trainer.world_size)
        totals = self.window.close(lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"), self.device)
        factor = gradient_factor(totals.count, trainer.accumulate_grad_batches, trainer.world_size)
        scale_gradients((p for group in optimizer.param_groups for p in group["params"]), factor)
        self.tokens_seen += totals.tokens
        self.response_tokens_seen += totals.answer_tokens
        self.log("train/loss", totals.loss, prog_bar=True, batch_size=1)
        self.log(f"train/{self.objective.count_name}", float(totals.count), batch_size=1)
        self.log("train/tokens", float(self.tokens_seen), batch_size=1)
        self.log("train/lr", optimizer.param_groups[0]["lr"], prog_bar=True, batch_size=1)
        for name, value in self.objective.metrics(totals.metric_sums, totals.count).items():
            self.log(f"train/{name}", value, batch_size=1)

    def on_fit_start(self) -> None:
        self.objective.on_fit_start(self)

    def on_validation_start(self) -> None:
        self.objective.on_validation_start(self)

    # -- validation metrics ---------------------------------------------------------------------

    def on_validation_epoch_start(self) -> None:
        self.val_sums.reset()

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """The objective's held-out sums, overall and per source (batches that carry ``source``)."""
        sums = self.objective_sums(batch)
        self.val_sums.add(batch.get("source"), sums.loss_sum, sums.count, sums.metric_sums)

    def on_validation_epoch_end(self) -> None:
        """``val/loss`` (the mean over every held-out unit of all ranks), ``val/<count>``, the
        objective's metrics (SFT: ``val/ppl``) and ``val/loss/<source>`` per named source."""
        overall, by_source = self.val_sums.close(
            lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"), self.device
        )
        if not overall.count:
            return
        loss = torch.tensor(overall.loss, dtype=torch.float64)
        objective = self.objective
        metrics = {"val/loss": loss, f"val/{objective.val_count_name or objective.count_name}": overall.count}
        metrics.update({f"val/{k}": v for k, v in objective.validation_metrics(loss).items()})
        finished = objective.metrics(overall.metric_sums, overall.count)
        metrics.update({f"val/{name}": value for name, value in finished.items()})
        for name, totals in sorted(by_source.items()):
            metrics[f"val/loss/{name}"] = totals.loss
        as_floats = {k: torch.as_tensor(v, dtype=torch.float64).float() for k, v in metrics.items()}
        self.log_dict(as_floats, sync_dist=True)  # equal on every rank already
        if not self.trainer.sanity_checking:
            self.last_val_step = self.global_step

    # -- optimizer ------------------------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        """The optimizer over the adapter weights (LoRA+: B matrices in a group of their own at
        ``loraplus_lr_ratio`` times the learning rate), on the warmup-cosine schedule."""
        hparams, ratio = self.hparams, self.lora_config.loraplus_lr_ratio
        groups: list[dict[str, Any]] = (
            loraplus_groups(self.model) if ratio is not None else [{"params": self.adapter_parameters()}]
        )
        if self._sharded:  # weights FSDP leaves whole (a vision tower's) beside sharded ones: an
            for group in groups:  # optimizer's foreach kernels take one kind at a time
                if len(placement_parts(group["params"])) > 1:
                    group["foreach"] = False
        if self.optimizer_factory is not None:  # its own learning rate is the peak of the schedule
            optimizer = self.optimizer_factory(groups)
        else:
            optimizer = adamw(groups, hparams["learning_rate"], hparams["betas"], hparams["weight_decay"])
        if ratio is not None:
            optimizer.param_groups[1]["lr"] = optimizer.param_groups[0]["lr"] * ratio
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = warmup_cosine(hparams["warmup_steps"], total, hparams["min_lr_ratio"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, over sharded and whole weights at once under FSDP with a vision
        tower kept whole (torch's clipping takes one kind at a time): the norm is that of all the
        gradients together, as on one process."""
        grads = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        parts = placement_parts(grads)
        if not gradient_clip_val or len(parts) < 2:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        if gradient_clip_algorithm == "value":
            for part in parts:
                torch.nn.utils.clip_grad_value_(part, gradient_clip_val)
            return
        norms = []
        for part in parts:
            norm = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in part if p.grad is not None]))
            assert norm is not None
            norms.append(norm.to(torch.float32))
        total = torch.linalg.vector_norm(torch.stack(norms))
        for part in parts:
            torch.nn.utils.clip_grads_with_norm_(part, gradient_clip_val, total)

    def adapter_parameters(self) -> list[nn.Parameter]:
        """The trained weights, in module order."""
        return [p for p in self.parameters() if p.requires_grad]

    # -- checkpoints and the adapter ------------------------------------------------------------

    def _trainable_names(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter weights: what a checkpoint stores."""
        names = self._trainable_names()
        return {k: v for k, v in self.state_dict().items() if k in names}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep only the trainable (adapter) weights: the frozen base is reloaded from ``model``."""
        names = self._trainable_names()  # the strategy's state dict: whole tensors under FSDP too
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in names}
        checkpoint["tokens_seen"] = (self.tokens_seen, self.response_tokens_seen)
        if self.eva_ranks is not None:
            checkpoint[EVA_RANKS_KEY] = dict(self.eva_ranks)
        repeats = self.objective.window_repeats
        if repeats > 1 and self.global_step % repeats:  # inside a rollout's steps: every rank's rollout
            checkpoint[OBJECTIVE_STATE_KEY] = gather_states(self.objective.state_dict())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Complete the stored adapter weights with the frozen base already loaded, so that loading
        stays strict: a checkpoint that lacks an adapter weight is still an error. (Sharded, the
        strategy has loaded the adapter weights already.)"""
        self.tokens_seen, self.response_tokens_seen = checkpoint.get("tokens_seen", (0, 0))
        check_eva_ranks(checkpoint.get(EVA_RANKS_KEY), self.eva_ranks)
        states = checkpoint.get(OBJECTIVE_STATE_KEY) or []
        rank = self.global_rank
        self.objective.load_state_dict(states[rank] if rank < len(states) else {})
        if self._sharded:
            return
        trainable = self._trainable_names()
        base = {k: v for k, v in self.state_dict().items() if k not in trainable}
        checkpoint["state_dict"] = {**base, **checkpoint["state_dict"]}

    def adapter_path(self) -> Path:
        """Where the adapter is written: ``adapter_dir``, else ``<log dir>/adapter``."""
        if self.hparams["adapter_dir"]:
            return Path(self.hparams["adapter_dir"])
        return log_dir(self.trainer) / "adapter"

    def on_fit_end(self) -> None:
        """Write the PEFT adapter (rank 0, atomically), with the chat template the data was rendered
        with (an :class:`InstructDataModule`'s ``training_chat_template``)."""
        path = self.adapter_path()  # on every rank: the log directory is broadcast from rank 0
        state = gathered_trainable_state(self.model) if self._sharded else None  # collective
        fallback = log_dir(self.trainer) / f"adapter-step={self.trainer.global_step}"  # on every rank too
        if self.trainer.is_global_zero:
            try:
                self.saved_adapter = self.write_adapter(path, state)
            except ConfigError as refused:  # the folder changed while training: keep the adapter
                self.saved_adapter = self.write_adapter(fallback, state)
                rank_zero_warn(f"lit-instruct: {refused}; the adapter is written to {fallback} instead")

    def write_adapter(
        self,
        path: str | Path,
        state: dict[str, torch.Tensor] | None = None,
        setting: str = "model.adapter_dir",
    ) -> Path:
        """Write the PEFT adapter to ``path`` (atomically; ``state``: whole tensors gathered from a
        sharded model) with the chat template the data was rendered with, the grown tokenizer when
        tokens were added, as plain LoRA on the original base after a residual init, and its model
        card (:meth:`training_card`); ``setting`` names the folder in a refusal."""
        template_of = getattr(getattr(self._trainer, "datamodule", None), "training_chat_template", None)
        template = template_of() if callable(template_of) else self.chat_template
        tokenizer = self.tokenizer() if self.hparams.get("added_tokens") else None  # a grown vocabulary
        convert = None
        if self.initial_adapter is not None:
            convert = functools.partial(as_plain_lora, initial=self.initial_adapter)
        return save_adapter(
            self.model,
            path,
            state,
            template,
            tokenizer,
            convert,
            base=self.hparams["model"],
            setting=setting,
            card=self.training_card().text(),
        )

    def training_card(self) -> TrainingCard:
        """What the adapter's model card says: base, objective, LoRA settings, the training sources'
        counts (an :class:`InstructDataModule`'s), the steps, the last ``val/*`` metrics and the
        settings of a pair objective."""
        trainer = self._trainer
        objective = self.objective.name or type(self.objective).__name__.lower()
        preference = None  # a pair objective's settings, as ``eval`` on pairs reads them back
        if isinstance(self.objective, PairObjective):
            preference = {"kind": self.objective.kind, **self.objective.settings()}
        counts = getattr(getattr(getattr(trainer, "datamodule", None), "prepared", None), "counts", None)
        sources = {name: dict(c) for name, c in (counts or {}).get("train", {}).items()}
        metrics = {}
        for name, value in trainer.callback_metrics.items() if trainer is not None else ():
            if name.startswith("val/") and value.numel() == 1:
                metrics[name] = float(value)
        steps = trainer.global_step if trainer is not None else 0
        lora = self.hparams["lora"]
        loss_on = LOSS_ON.get(self.objective.batch_kind)
        return TrainingCard(
            self.hparams["model"], objective, lora, steps, sources, metrics, preference, loss_on
        )
