"""EVA (``lora.init: eva``): the data pass equals peft's own EVA, takes a bounded number of batches
(from a stream too), and its ranks travel with the checkpoint: a resume rebuilds them, without a
data pass, and continues the uninterrupted run."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import EvaConfig, LoraConfig, get_peft_model
from peft.tuners.lora.eva import initialize_lora_eva_weights
from transformers import AutoModelForCausalLM

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.models.eva_init import EVA_BATCHES
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import EVA_RANKS_KEY, InstructLoRAModule
from tests.helpers import StopAfter, assert_resumed_as_uninterrupted, make, recorded_fit, write_chats

EVA = LoRAConfig(r=1, alpha=2, init="eva", dropout=0.1)  # dropout: the RNG state matters on resume
"""On the tiny model and ``chat_file`` in batches of 2, EVA gives some layers rank 0 (peft removes
their adapters) and some rank 2."""

OTHER_CHATS = [  # other data: a data pass over it draws other ranks
    [
        ("user", f"Tell me about the number {i}."),
        ("assistant", f"The number {i} is {'odd' if i % 2 else 'even'}."),
    ]
    for i in range(8)
]


def lora_a(module: InstructLoRAModule) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.model.named_parameters() if "lora_A" in n}


def test_eva_sets_the_adapters_as_peft_does_from_the_training_batches(tiny_model_dir, chat_file) -> None:
    """The data pass through the trunk gives the A matrices and redistributed ranks peft's own EVA
    computes, with its own loop and stopping rule, through the whole model, on the same loader: one
    batch (all 7 samples), which its incremental SVD converges on."""
    module, data = make(tiny_model_dir, chat_file, batch_size=8, lora=LoRAConfig(r=4, alpha=8, init="eva"))
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) == 1
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights="eva")
    config.eva_config = EvaConfig()
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), config
    )

    def whole_model(model, batch):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    torch.manual_seed(0)
    initialize_lora_eva_weights(reference, batches, forward_fn=whole_model, show_progress_bar=False)
    torch.manual_seed(0)
    result = module.initialise_eva(data.train_dataloader())
    assert (
        result.converged and result.batches == 1 and 2 <= result.steps < EVA_BATCHES
    )  # peft's stop, not ours
    ours, theirs = lora_a(module), dict(reference.named_parameters())
    assert {n: p.shape[0] for n, p in ours.items()} == {n: theirs[n].shape[0] for n in ours}
    assert len({p.shape[0] for p in ours.values()}) > 1  # ranks redistributed
    for name, weight in ours.items():
        torch.testing.assert_close(
            weight, theirs[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert module.fused_layers is not None and module.model.peft_config["default"].rank_pattern
    assert module.eva_ranks == {n.removesuffix(".lora_A.default.weight"): p.shape[0] for n, p in ours.items()}


class Endless:
    """``batches`` cycled without end, as a stream gives them; reading past ``limit`` fails."""

    def __init__(self, batches: list[dict], limit: int) -> None:
        self.batches, self.limit, self.read = batches, limit, 0

    def __iter__(self) -> Iterator[dict]:
        for batch in itertools.cycle(self.batches):
            assert self.read < self.limit, f"read past {self.limit} batches"
            self.read += 1
            yield batch


def test_eva_takes_a_bounded_number_of_batches_from_an_endless_loader(tiny_model_dir, chat_file) -> None:
    module, data = make(tiny_model_dir, chat_file, batch_size=2, lora=EVA)
    data.setup("fit")
    loader = Endless(list(data.train_dataloader()), limit=EVA_BATCHES)
    result = module.initialise_eva(loader)
    assert loader.read == result.batches == EVA_BATCHES and 2 <= result.steps <= EVA_BATCHES
    assert module.eva_ranks and len(set(module.eva_ranks.values())) > 1  # redistributed


def streamed(
    tiny_model_dir: Path, corpus: Path, lora: LoRAConfig
) -> tuple[InstructLoRAModule, InstructDataModule]:
    L.seed_everything(0)
    module = InstructLoRAModule(model=str(tiny_model_dir), lora=lora, learning_rate=1e-2, warmup_steps=0)
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir),
        train_files=[str(corpus)],
        streaming=True,
        shuffle_buffer=3,
        batch_size=2,
    )
    return module, data


class FirstBatches(L.Callback):
    """The input ids of the training batches, as the training step receives them."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.ids.append(batch["input_ids"].clone())


def test_eva_on_a_stream_reads_its_start_and_leaves_the_training_stream_in_place(
    tiny_model_dir, chat_file, tmp_path
) -> None:
    """The stream never ends: the data pass takes its first batches (the bound), and training then
    starts at the stream's start, as without EVA."""
    module, data = streamed(tiny_model_dir, chat_file, EVA)
    with_eva = FirstBatches()
    recorded_fit(module, data, tmp_path / "eva", 3, with_eva)
    assert module.eva_result is not None and module.eva_result.batches == EVA_BATCHES
    plain, data = streamed(tiny_model_dir, chat_file, LoRAConfig(r=1, alpha=2))
    without = FirstBatches()
    recorded_fit(plain, data, tmp_path / "plain", 3, without)
    assert len(with_eva.ids) == len(without.ids) == 3
    for a, b in zip(with_eva.ids, without.ids, strict=True):
        assert torch.equal(a, b)
    # the pass read the stream's first batches: a fresh stream's first ones draw the same ranks
    again, data = streamed(tiny_model_dir, chat_file, EVA)
    data.setup("fit")
    again.initialise_eva(data.train_dataloader())
    assert again.eva_ranks == module.eva_ranks


def fit_eva(tiny_model_dir, chat_file, root, *callbacks, ckpt_path=None):
    module, data = make(tiny_model_dir, chat_file, batch_size=2, lora=EVA)
    return recorded_fit(module, data, root, 6, *callbacks, ckpt_path=ckpt_path), module


def test_a_resumed_eva_fit_continues_the_uninterrupted_run(tiny_model_dir, chat_file, tmp_path) -> None:
    """Stopped after 4 of 6 steps (mid-epoch: 3 batches an epoch) and resumed: the resumed module
    rebuilds the checkpoint's ranks without a data pass, and its 2 further steps and final weights are
    the uninterrupted run's."""
    uninterrupted, whole = fit_eva(tiny_model_dir, chat_file, tmp_path / "whole")
    every_4 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    fit_eva(tiny_model_dir, chat_file, tmp_path / "first", every_4, StopAfter(4))
    path = tmp_path / "ckpt" / "epoch=1-step=4.ckpt"
    assert whole.eva_ranks and 0 in whole.eva_ranks.values()  # the resume removes those adapters again
    assert torch.load(path, weights_only=True)[EVA_RANKS_KEY] == whole.eva_ranks
    resumed, again = fit_eva(tiny_model_dir, chat_file, tmp_path / "again", ckpt_path=path)
    assert again.eva_result is None and again.eva_ranks == whole.eva_ranks  # no data pass
    assert_resumed_as_uninterrupted(resumed, uninterrupted, done=4)
    config, expected = again.model.peft_config["default"], whole.model.peft_config["default"]
    assert expected.rank_pattern and (config.rank_pattern, config.alpha_pattern) == (
        expected.rank_pattern,
        expected.alpha_pattern,
    )


class WeightsAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {k: v.clone() for k, v in pl_module.trainable_state_dict().items()}


@pytest.fixture
def other_chat_file(tmp_path: Path) -> Path:
    path = tmp_path / "other.jsonl"
    return write_chats(path, OTHER_CHATS)


def test_a_resume_takes_the_checkpoints_eva_ranks_where_a_data_pass_would_draw_others(
    tiny_model_dir, chat_file, other_chat_file, tmp_path
) -> None:
    """As on another device, whose data pass may draw other ranks: resumed on other data, the
    adapters are those of the checkpoint, ranks and weights."""
    every_3 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _, first = fit_eva(tiny_model_dir, chat_file, tmp_path / "first", every_3, StopAfter(3))
    checkpoint = torch.load(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", weights_only=True)
    fresh, other = make(tiny_model_dir, other_chat_file, batch_size=2, lora=EVA)
    other.setup("fit")
    fresh.initialise_eva(other.train_dataloader())
    assert fresh.eva_ranks != first.eva_ranks  # what a data pass on the resumed fit's data would give

    start = WeightsAtStart()
    _, resumed = fit_eva(
        tiny_model_dir,
        other_chat_file,
        tmp_path / "again",
        start,
        ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt",
    )
    assert resumed.eva_result is None and resumed.eva_ranks == checkpoint[EVA_RANKS_KEY] == first.eva_ranks
    assert start.weights.keys() == checkpoint["state_dict"].keys()
    for name, tensor in checkpoint["state_dict"].items():
        torch.testing.assert_close(
            start.weights[name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_a_checkpoint_with_other_eva_ranks_is_refused(tiny_model_dir, chat_file) -> None:
    """Adapters set already (here by a data pass) and a checkpoint of other ranks: an error naming
    the layers, not a load into other shapes."""
    module, data = make(tiny_model_dir, chat_file, batch_size=2, lora=EVA)
    data.setup("fit")
    module.initialise_eva(data.train_dataloader())
    assert module.eva_ranks is not None
    other = copy.deepcopy(module.eva_ranks)
    name = next(iter(other))
    other[name] += 1
    state = module.trainable_state_dict()
    with pytest.raises(ValueError, match=rf"EVA ranks differ from this model's at 1 layers \(\['{name}'\]\)"):
        module.on_load_checkpoint({EVA_RANKS_KEY: other, "state_dict": state})
    module.on_load_checkpoint({EVA_RANKS_KEY: dict(module.eva_ranks), "state_dict": state})  # the same: fine


@pytest.mark.parametrize("packing", ["false", "true"])
def test_eva_trains_through_lit_instruct_fit(packing, tiny_model_dir, chat_file, tmp_path) -> None:
    from lit_instruct.export.adapter import merged_model
    from tests.test_config_swaps import fit

    args = ["--model.lora.init", "eva", "--model.lora.r", "2", "--data.batch_size", "4"]  # >= r * rho tokens
    args += ["--data.packing", packing, "--model.adapter_dir", str(tmp_path / "adapter")]
    assert fit(tiny_model_dir, chat_file, tmp_path, *args).trainer.global_step == 2
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["init_lora_weights"] == "eva" and saved["rank_pattern"]
    merged_model(tmp_path / "adapter")  # peft loads it as any adapter (no data pass)
