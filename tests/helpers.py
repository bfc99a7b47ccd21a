"""Helpers shared by the test files (fixtures live in ``conftest.py``; pytest advises against
importing conftest, so plain functions and classes live here): the tiny module and its data, a
Trainer for tests, modules that fail on purpose, recorders, and bad-record samples."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import lightning as L
import torch

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule


def make(
    tiny_model_dir: Path,
    chat_file: Path,
    module_cls: type[InstructLoRAModule] = InstructLoRAModule,
    batch_size: int = 3,
    packing: bool = False,
    **kwargs,
) -> tuple[InstructLoRAModule, InstructDataModule]:
    """The tiny model with small LoRA adapters (``kwargs`` override the module's defaults) and its
    data, both packed or both padded."""
    L.seed_everything(0)
    defaults = dict(
        model=str(tiny_model_dir), lora=LoRAConfig(r=4, alpha=8), learning_rate=1e-2, warmup_steps=0
    )
    module = module_cls(**{**defaults, **kwargs}, packing=packing)
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir),
        train_files=[str(chat_file)],
        val_files=[str(chat_file)],
        batch_size=batch_size,
        packing=packing,
    )
    return module, data


def trainer(root: Path, **kwargs) -> L.Trainer:
    """A quiet CPU Trainer: 2 steps, no logger, checkpoint, progress bar or sanity check."""
    defaults = dict(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    return L.Trainer(**{**defaults, **kwargs})


class GradCapture(InstructLoRAModule):
    """Records the gradients the optimizer is given (after normalization, where clipping would run)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.captured = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class FaultyModule(InstructLoRAModule):
    """Multiplies the loss by NaN, or puts an Inf into one LoRA gradient, at chosen batch indices
    (on every rank, or on ``fault_rank`` only)."""

    def __init__(
        self,
        *args,
        nan_loss_at: tuple[int, ...] = (),
        inf_grad_at: tuple[int, ...] = (),
        fault_rank: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.nan_loss_at, self.inf_grad_at, self.fault_rank = set(nan_loss_at), set(inf_grad_at), fault_rank
        self._batch_idx = -1

    def _faulty_here(self, batch_indices: set[int]) -> bool:
        rank_ok = self.fault_rank is None or self.global_rank == self.fault_rank
        return rank_ok and self._batch_idx in batch_indices

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._batch_idx = batch_idx
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self._faulty_here(self.nan_loss_at) else loss

    def on_after_backward(self) -> None:
        if self._faulty_here(self.inf_grad_at):
            next(p for p in self.parameters() if p.grad is not None).grad[0, 0] = float("inf")


class Recorder(L.Callback):
    """After every training batch: the LoRA weights, the optimizer state and the learning rate
    (``states``), and the logged ``train/loss`` (``losses``)."""

    def __init__(self) -> None:
        self.states: list[tuple[dict, dict, float]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        weights = {k: v.clone() for k, v in pl_module.trainable_state_dict().items()}
        self.states.append((weights, copy.deepcopy(optimizer.state_dict()), optimizer.param_groups[0]["lr"]))
        self.losses.append(float(trainer.callback_metrics.get("train/loss", float("nan"))))


class StopAfter(L.Callback):
    """Ends the fit after ``steps`` optimizer steps, as if the job had been killed there."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


class SlowSteps(L.Callback):
    """Each training step takes ``seconds`` longer (a real model's step, for signals to land in)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        time.sleep(self.seconds)


def lora_fit_args(model: Path, chat_file: Path, *extra: str) -> list[str]:
    """``lit-instruct fit`` with ``configs/lora.yaml`` on ``model`` and ``chat_file``, then ``extra``."""
    config = Path(__file__).resolve().parents[1] / "configs" / "lora.yaml"
    return [
        "fit",
        "--config",
        str(config),
        "--model.model",
        str(model),
        "--data.train_files",
        f"[{chat_file}]",
        *extra,
    ]


class Checked(Exception):
    """Raised with the parsed config once checked as ``fit`` checks it, instead of loading weights."""


def checked_config(args: list[str]) -> dict:
    """``args`` (a ``fit`` command line) parsed and checked as ``fit`` does, no weights read: the
    config as it would be instantiated."""
    import pytest

    from lit_instruct.cli import InstructCLI

    class CheckedOnly(InstructCLI):
        def instantiate_classes(self) -> None:
            self.checked_config()
            raise Checked(self.parsed().as_dict())

    with pytest.raises(Checked) as parsed:
        CheckedOnly(args=args)
    return parsed.value.args[0]


def tiny_adapter(model: Path, folder: Path) -> Path:
    """A LoRA adapter (rank 2, ``q_proj``) of ``model``, written at ``folder`` as training writes it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lit_instruct.adapter_folder import save_adapter

    base = AutoModelForCausalLM.from_pretrained(model)
    return save_adapter(
        get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])), folder, base=str(model)
    )


def write_chats(path: Path, chats: list[list[tuple[str, str]]]) -> Path:
    """``chats`` ((role, content) turns each) as a chat JSONL file at ``path``."""
    rows = [{"messages": [{"role": r, "content": c} for r, c in chat]} for chat in chats]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_pairs(path: Path, answers: list[str]) -> Path:
    """A pairs JSONL file at ``path``: question ``i`` chooses ``answers[i]`` over the answer two on."""
    rows = [
        {"prompt": f"Question {i}?", "chosen": answer, "rejected": answers[(i + 2) % len(answers)]}
        for i, answer in enumerate(answers)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class SeenSamples(L.Callback):
    """Every sample a training batch trained on, with its epoch: ``(epoch, token ids)`` (padding left
    out, and the repeats that even out the ranks, which count no token)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple[int, ...]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        mask = batch["attention_mask"].bool()
        for ids, keep, labels in zip(batch["input_ids"], mask, batch["labels"], strict=True):
            if bool((labels != IGNORE_INDEX).any()):
                self.seen.append((trainer.current_epoch, tuple(ids[keep].tolist())))


GOOD = '{"prompt": "ok", "completion": "ok"}'
BAD_LINES = {  # reason: (line 2 of a file between two good lines, the expected message after "file:2: ")
    "bad_type": ('{"prompt": "x", "completion": 3}', r"field 'completion' must be a string, got int"),
    "missing_field": ('{"instruction": "x"}', r"field 'output' is missing"),
    "unknown_format": ('{"body": "x"}', r"record has keys \['body'\]; expected 'messages'"),
    "truncated_line": ('{"prompt": "x", "completion": "y', r"line is truncated: the JSON ends early"),
    "invalid_json": ('{"prompt": "x" "completion": "y"}', r"invalid JSON at column 16: Expecting ','"),
    "blank_line": ("", r"blank line"),
    "bad_role": ('{"messages": [{"role": "bot", "content": "x"}]}', r"field 'messages\[0\].role' is 'bot'"),
    "empty_content": (
        '{"prompt": "x", "completion": " "}',
        r"field 'messages\[1\].content' \(assistant\) is empty",
    ),
    "no_final_answer": (
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "and?"},
                ]
            }
        ),
        r"the conversation ends with a user turn \(messages\[2\]\)",
    ),
    "not_an_object": ("[1, 2]", r"record must be a JSON object, got list"),
}


def recorded_fit(
    module: InstructLoRAModule,
    data: L.LightningDataModule,
    root: Path,
    max_steps: int,
    *callbacks,
    **fit_kwargs,
) -> Recorder:
    """Fit deterministically for ``max_steps`` (no validation) with a :class:`Recorder` and ``callbacks``;
    ``fit_kwargs`` go to ``Trainer.fit`` (``ckpt_path``)."""
    recorder = Recorder()
    run = trainer(root, max_steps=max_steps, limit_val_batches=0, deterministic=True)
    run.callbacks += [recorder, *callbacks]
    run.fit(module, datamodule=data, **fit_kwargs)
    return recorder


def assert_resumed_as_uninterrupted(resumed: Recorder, uninterrupted: Recorder, done: int) -> None:
    """The steps after a resume at step ``done`` have the uninterrupted run's losses, and end on its
    weights."""
    assert len(resumed.losses) == len(uninterrupted.losses) - done > 0
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(uninterrupted.losses[done:]), atol=1e-6, rtol=0
    )
    final, expected = resumed.states[-1][0], uninterrupted.states[-1][0]
    assert final.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            final[name], expected[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def pair_losses(module: InstructLoRAModule, batch: dict) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A pair objective's sums of ``batch``: the summed loss, the metric sums (in the objective's
    ``metric_names`` order), the counted pairs and their answers' tokens."""
    batch = {"num_pairs": len(batch["input_ids"]) // 2, **batch}  # the collator's [chosen; rejected] rows
    sums = module.objective_sums(batch)
    assert sums.metric_sums is not None
    return sums.loss_sum, sums.metric_sums, sums.count, sums.answer_tokens


def pair_logps(module: InstructLoRAModule, batch: dict):
    """Each answer's summed log-probability under ``module`` as it is now (its pair objective's
    ``ld_alpha``)."""
    from lit_instruct.objectives.pairs import answer_logps_of

    ld_alpha = module.objective.preference_loss.ld_alpha  # type: ignore[attr-defined]
    return answer_logps_of(module, batch, module.trunk(batch)[0], ld_alpha)


def trl_online_trainer(
    kind: str,
    model: Path,
    tokenizer,
    out: Path,
    rewards,
    rows: list[dict],
    batch_size: int,
    max_completion_length: int,
    **config,
):
    """TRL 1.16's ``GRPOTrainer`` (``kind`` ``grpo``) or ``RLOOTrainer`` (``rloo``) over ``rows`` in fp32
    on the CPU: 2 completions a prompt, LoRA r 4 on q/v with its B matrices perturbed (the policy is
    not its reference), in train mode, ready for its internals to be called."""
    import warnings

    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from tests.test_preference_loss import _load, _perturb_lora

    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    args = config_class(
        output_dir=str(out / kind),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=batch_size,
        num_generations=2,
        max_completion_length=max_completion_length,
        **config,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(
            model=_load(model),
            reward_funcs=rewards,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
        )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    _perturb_lora(trainer.model, scale=0.05)
    return trainer
