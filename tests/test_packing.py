"""Padding-free packing: exact rows, attention that stays inside each sample, same training."""

from __future__ import annotations

import pytest
import torch

from lit_instruct.data.collate import PackCollator
from lit_instruct.data.render import Sample
from lit_instruct.errors import ConfigError
from lit_instruct.labels import IGNORE_INDEX
from lit_instruct.models.packing import PACKED_ATTENTION, attention_implementation
from tests.helpers import GradCapture, Recorder, make, trainer


def test_pack_collator_builds_one_row_with_restarting_positions() -> None:
    samples = [Sample([1, 2, 3], [IGNORE_INDEX, 2, 3], "a"), Sample([4, 5], [4, 5], "b")]
    batch = PackCollator()(samples)
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3, 4, 5]]))
    assert torch.equal(batch["labels"], torch.tensor([[IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5]]))
    assert torch.equal(batch["position_ids"], torch.tensor([[0, 1, 2, 0, 1]]))
    assert batch["packed_segments"] == (0, 3, 5)


def test_packed_hidden_states_equal_each_sample_alone(tiny_model_dir, chat_file) -> None:
    module, data = make(tiny_model_dir, chat_file, packing=True)
    data.setup("fit")
    samples = data.train_samples[:4]
    module.eval()
    with torch.no_grad():
        packed = module.hidden_states(PackCollator()(samples))[0]
        alone = [module.hidden_states({"input_ids": torch.tensor([s.input_ids])})[0] for s in samples]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)


def test_packed_training_equals_padded_training(tiny_model_dir, chat_file, tmp_path) -> None:
    runs = {}
    for packing in (False, True):
        module, data = make(
            tiny_model_dir, chat_file, GradCapture, batch_size=3, warmup_steps=0, packing=packing
        )
        recorder = Recorder()
        run = trainer(tmp_path, max_steps=4, limit_val_batches=0, callbacks=[recorder])
        run.fit(module, datamodule=data)
        runs[packing] = (module.captured, recorder.losses, module.trainable_state_dict(), module.tokens_seen)
    (padded_grads, padded_losses, padded_weights, padded_tokens) = runs[False]
    (packed_grads, packed_losses, packed_weights, packed_tokens) = runs[True]
    torch.testing.assert_close(torch.tensor(packed_losses), torch.tensor(padded_losses), atol=1e-5, rtol=0)
    for name, grad in padded_grads.items():  # the last step's gradients
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=0)
    for name, weight in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], weight, atol=1e-5, rtol=0)
    assert packed_tokens == padded_tokens  # padding is never counted as a token


@pytest.mark.parametrize(
    "options",
    [
        {"gradient_checkpointing": True},
        {"gradient_checkpointing": True, "checkpoint_layers": 1},
        pytest.param({"compile_layers": True}, marks=pytest.mark.slow),
    ],
    ids=["checkpointing", "checkpointing-1-layer", "compile"],
)
def test_speed_and_memory_options_give_the_same_gradients(
    tiny_model_dir, chat_file, tmp_path, options
) -> None:
    grads = {}
    for enabled in (False, True):
        module, data = make(
            tiny_model_dir, chat_file, GradCapture, packing=True, **(options if enabled else {})
        )
        if enabled and "checkpoint_layers" in options:  # the first layer recomputes, the second keeps
            layers = module.base_model.get_decoder().layers
            assert [layer.gradient_checkpointing for layer in layers] == [True, False]
        steps = 1 if "compile_layers" in options else 2  # compiling each new shape dominates: one
        trainer(tmp_path, max_steps=steps, limit_val_batches=0).fit(module, datamodule=data)
        grads[enabled] = module.captured
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-5, rtol=1e-4)


def test_bf16_autocast_trains_packed_with_the_fused_loss_like_fp32(
    tiny_model_dir, chat_file, tmp_path
) -> None:
    """``precision: bf16-mixed`` (the fast path on hardware with bf16) on the fast path's parts:
    packing, per-sample attention and the fused loss; same losses as fp32 to bf16 resolution."""
    losses = {}
    for precision in ("32-true", "bf16-mixed"):
        module, data = make(tiny_model_dir, chat_file, warmup_steps=0, packing=True)
        recorder = Recorder()
        run = trainer(
            tmp_path,
            max_steps=3,
            limit_val_batches=0,
            precision=precision,
            strategy="one_device",
            callbacks=[recorder],
        )
        run.fit(module, datamodule=data)
        losses[precision] = torch.tensor(recorder.losses)
    assert losses["bf16-mixed"].isfinite().all()
    torch.testing.assert_close(losses["bf16-mixed"], losses["32-true"], atol=0, rtol=2e-2)
    assert not torch.equal(losses["bf16-mixed"], losses["32-true"])  # autocast really ran in bf16


def test_checkpoint_layers_needs_gradient_checkpointing(tiny_model_dir, chat_file) -> None:
    refusal = r"^model\.checkpoint_layers: 1 cannot be combined with model\.gradient_checkpointing: false"
    with pytest.raises(ConfigError, match=refusal):
        make(tiny_model_dir, chat_file, checkpoint_layers=1)


def test_packed_data_needs_a_model_built_for_it(tiny_model_dir, chat_file, tmp_path) -> None:
    module, data = make(tiny_model_dir, chat_file)
    data.packing = True
    with pytest.raises(ValueError, match=r"InstructLoRAModule\(packing=True\)"):
        trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(module, datamodule=data)


def test_attention_implementation_reads_what_transformers_sets(tiny_model_dir) -> None:
    """The one private read of ``transformers`` (no public getter in version 5) follows the public
    setter, and packing switches it at build time."""
    module, _ = make(tiny_model_dir, tiny_model_dir, attn_implementation="eager")
    assert attention_implementation(module.base_model) == "eager"
    module.base_model.set_attn_implementation("sdpa")
    assert attention_implementation(module.base_model) == "sdpa"
    packed, _ = make(tiny_model_dir, tiny_model_dir, packing=True)
    assert attention_implementation(packed.base_model) == PACKED_ATTENTION["sdpa"]


def test_the_build_check_runs_samples_longer_than_every_window_the_config_names() -> None:
    from types import SimpleNamespace

    import transformers

    from lit_instruct.models.packing import check_lengths

    def lengths(config_class: str, **kwargs) -> tuple[int, int]:
        return check_lengths(SimpleNamespace(config=getattr(transformers, config_class)(**kwargs)))

    assert lengths("LlamaConfig") == (5, 3)  # no window
    assert lengths("MistralConfig", sliding_window=64) == (67, 65)
    assert lengths("Llama4TextConfig", attention_chunk_size=16) == (19, 17)  # chunked attention
    assert lengths("Qwen2Config", sliding_window=64, use_sliding_window=False) == (5, 3)  # window off
    assert lengths("MistralConfig", sliding_window=4096, max_position_embeddings=1024) == (1024, 1024)
