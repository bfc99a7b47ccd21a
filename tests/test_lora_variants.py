"""LoRA variants (DoRA, rsLoRA, gaussian init, layer subsets, rank/alpha patterns, LoRA+) equal peft's
own computation; continuing from an adapter equals continuing the run that saved it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.optimizers import create_loraplus_optimizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule
from tests.families import build_family
from tests.helpers import Recorder, StopAfter, assert_resumed_as_uninterrupted, make, recorded_fit, trainer

VARIANTS = {
    "dora": {"use_dora": True},
    "rslora": {"use_rslora": True},
    "gaussian": {"init": "gaussian"},
    "layers": {"layers_to_transform": [1]},
    "patterns": {"rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 3.0}},
    "pissa": {"init": "pissa"},  # peft rebuilds the same residual base from the pristine one
    "olora": {"init": "olora"},
}


def batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two rows of 12 tokens, the first 5 of each masked as prompt, the second row right-padded by 3."""
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def assert_equals_peft(module: InstructLoRAModule, base_dir: Path) -> None:
    """The module's loss and adapter gradients = peft's own model (same config and weights) on the
    base's own forward with labels."""
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero B (and moved magnitudes): every factor gets a gradient
        for p in module.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        copy.deepcopy(module.model.peft_config["default"]),
    )
    set_peft_model_state_dict(reference, get_peft_model_state_dict(module.model))
    reference.train()
    data = batch(module.base_model.config.vocab_size)
    loss_sum, count = module.loss_sum_and_count(data)
    (loss_sum / count).backward()
    expected = reference(**data, use_cache=False).loss
    expected.backward()
    torch.testing.assert_close(loss_sum / count, expected, rtol=1e-5, atol=1e-6)
    ours = {n.removeprefix("model."): p.grad for n, p in module.named_parameters() if p.requires_grad}
    theirs = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys() and ours
    for name, grad in theirs.items():
        scale = float(grad.abs().max())  # float32 sums in another order: 1e-5 of the tensor's largest entry
        torch.testing.assert_close(
            ours[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_variant_equals_peft_on_llama(variant, tiny_model_dir) -> None:
    lora = LoRAConfig(r=4, alpha=8, **VARIANTS[variant])
    module = InstructLoRAModule(model=str(tiny_model_dir), lora=lora)
    config = module.model.peft_config["default"]
    names = [n for n, _ in module.model.named_parameters()]
    if variant == "dora":
        assert config.use_dora and any("lora_magnitude_vector" in n for n in names)
    if variant == "layers":
        assert config.layers_to_transform == [1] and not any(
            ".layers.0." in n and "lora_" in n for n in names
        )
    if variant == "patterns":
        (q_a,) = [p for n, p in module.model.named_parameters() if "layers.0.self_attn.q_proj.lora_A" in n]
        assert q_a.shape[0] == 2 and config.alpha_pattern == {"v_proj": 3.0}
    assert_equals_peft(module, tiny_model_dir)


@pytest.mark.parametrize("variant", ["dora", "rslora"])
def test_a_variant_equals_peft_on_a_moe(variant, tmp_path) -> None:
    base = build_family("qwen3_moe", 49152, tmp_path / "moe")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if variant == "dora" else ["all-linear"]
    lora = LoRAConfig(r=4, alpha=8, target_modules=targets, **VARIANTS[variant])
    assert_equals_peft(InstructLoRAModule(model=str(base), lora=lora), base)


def test_dora_on_expert_weights_and_inits_we_cannot_do_are_refused(tiny_model_dir, tmp_path) -> None:
    base = build_family("qwen3_moe", 49152, tmp_path / "moe")
    with pytest.raises(ValueError, match="DoRA cannot"):
        InstructLoRAModule(model=str(base), lora=LoRAConfig(r=4, use_dora=True))
    with pytest.raises(ValueError, match="adapted through its weight"):
        InstructLoRAModule(model=str(base), lora=LoRAConfig(r=4, init="pissa"))
    for init, why in (
        ("loftq", "LoftQ fits the NF4 quantization error"),
        ("corda", "covariance"),
        ("pissa_niter_", "must be one of"),
    ):
        with pytest.raises(ValueError, match=why):
            InstructLoRAModule(model=str(tiny_model_dir), lora=LoRAConfig(r=4, init=init))
    with pytest.raises(ValueError, match="plain LoRA"):
        InstructLoRAModule(model=str(tiny_model_dir), lora=LoRAConfig(r=4, init="olora", use_dora=True))


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora"])
def test_a_residual_init_saves_plain_lora_on_the_original_base(init, tiny_model_dir, tmp_path) -> None:
    """Trained on the residual base, saved as peft's own conversion writes it: rank 2r, and on the
    untouched base it gives the trained model's logits."""
    from peft import PeftModel

    torch.manual_seed(0)
    module = InstructLoRAModule(model=str(tiny_model_dir), lora=LoRAConfig(r=4, alpha=8, init=init))
    torch.manual_seed(0)  # the same randomized SVD for peft's own model
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        copy.deepcopy(module.model.peft_config["default"]),
    )
    reference.peft_config["default"].init_lora_weights = True  # peft's recipe: the initial adapter, as LoRA
    reference.save_pretrained(tmp_path / "initial")
    reference.peft_config["default"].init_lora_weights = init
    with torch.no_grad():  # "training"
        for p in module.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    set_peft_model_state_dict(reference, get_peft_model_state_dict(module.model))
    ours = module.write_adapter(tmp_path / "ours")
    reference.save_pretrained(
        tmp_path / "peft", path_initial_model_for_weight_conversion=tmp_path / "initial"
    )

    config, theirs_config = (
        json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft")
    )
    assert (config["r"], config["lora_alpha"]) == (theirs_config["r"], theirs_config["lora_alpha"]) == (8, 16)
    weights, theirs = (
        load_file(ours / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert weights.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)
    plain = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), ours
    )
    ids = batch(module.base_model.config.vocab_size)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=ids).logits, module.model.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )


def test_loraplus_groups_the_parameters_as_peft_does(tiny_model_dir, chat_file, tmp_path) -> None:
    module, data = make(
        tiny_model_dir, chat_file, lora=LoRAConfig(r=4, alpha=8, use_dora=True, loraplus_lr_ratio=16)
    )
    fit = trainer(tmp_path, max_steps=1, limit_val_batches=0)
    fit.fit(module, datamodule=data)
    (ours,) = fit.optimizers
    theirs = create_loraplus_optimizer(module.model, torch.optim.AdamW, lr=1e-2, loraplus_lr_ratio=16)

    def lr_of(optimizer) -> dict[int, float]:  # the peak learning rate of each parameter
        return {id(p): g.get("initial_lr", g["lr"]) for g in optimizer.param_groups for p in g["params"]}

    assert lr_of(ours) == lr_of(theirs)
    assert sorted(set(lr_of(ours).values())) == [1e-2, 1e-2 * 16]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def test_continuing_from_an_adapter_equals_continuing_the_run(tiny_model_dir, chat_file, tmp_path) -> None:
    """Train 2 steps and save the adapter; a module built from it holds the same adapter weights, and
    2 more steps of each (fresh SGD, constant learning rate, same data) end equal."""
    constant = {"optimizer": sgd, "warmup_steps": 0, "min_lr_ratio": 1.0}
    first, data = make(tiny_model_dir, chat_file, adapter_dir=str(tmp_path / "adapter"), **constant)
    trainer(tmp_path / "first", max_steps=2, limit_val_batches=0).fit(first, datamodule=data)
    again, _ = make(tiny_model_dir, chat_file, lora=None, adapter=str(tmp_path / "adapter"), **constant)
    assert again.lora_config == LoRAConfig(
        r=4, alpha=8, target_modules=sorted(again.model.peft_config["default"].target_modules)
    )
    state = lambda m: {k: v.clone() for k, v in m.trainable_state_dict().items()}  # noqa: E731
    before = state(first)
    torch.testing.assert_close(state(again), before, rtol=0, atol=0)
    for module, root in ((first, "first-more"), (again, "again")):
        _, fresh = make(tiny_model_dir, chat_file)
        trainer(tmp_path / root, max_steps=2, limit_val_batches=0).fit(module, datamodule=fresh)
    assert any(not torch.equal(a, b) for a, b in zip(state(first).values(), before.values(), strict=True))
    torch.testing.assert_close(state(again), state(first), rtol=0, atol=0)


def test_an_adapter_of_another_base_is_refused(tiny_model_dir, tmp_path) -> None:
    other = build_family("qwen3", 49152, tmp_path / "other")
    from lit_instruct.adapter_folder import save_adapter

    save_adapter(InstructLoRAModule(model=str(other), lora=LoRAConfig(r=4)).model, tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"does not fit this base model|another base"):
        InstructLoRAModule(model=str(tiny_model_dir), adapter=str(tmp_path / "adapter"))
    refusal = r"^model\.lora\.r: 8 cannot be combined with model\.adapter, trained with 4"
    with pytest.raises(ValueError, match=refusal):
        InstructLoRAModule(model=str(other), adapter=str(tmp_path / "adapter"), lora=LoRAConfig(r=8))


class GradientsBeforeTheStep(L.Callback):
    """The micro-batches of the first optimizer step and the gradients they left, before the module
    divides them by the window's token count (callbacks run first): those of the summed CE, each
    micro-batch's divided by ``accumulate_grad_batches`` by Lightning."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.grads:
            self.batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            named = pl_module.model.named_parameters()
            self.grads = {n: p.grad.clone() for n, p in named if p.requires_grad}


def test_dora_with_loraplus_under_one_device_and_accumulation_equals_peft(
    tiny_model_dir, chat_file, tmp_path
) -> None:
    from lit_instruct.train.strategy import OneDeviceStrategy

    lora = LoRAConfig(r=4, alpha=8, use_dora=True, loraplus_lr_ratio=4)
    module, data = make(tiny_model_dir, chat_file, lora=lora, batch_size=2)
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        copy.deepcopy(module.model.peft_config["default"]),
    )
    set_peft_model_state_dict(reference, get_peft_model_state_dict(module.model))
    seen = GradientsBeforeTheStep()
    run = trainer(
        tmp_path, max_steps=1, limit_val_batches=0, accumulate_grad_batches=2, callbacks=[seen],
        strategy=OneDeviceStrategy(),
    )  # fmt: skip
    run.fit(module, datamodule=data)
    assert len(seen.batches) == 2
    reference.train()
    for batch in seen.batches:  # the summed CE over the window's response tokens
        count = int((batch["labels"][:, 1:] != -100).sum())
        (reference(**batch, use_cache=False).loss * count).backward()
    theirs = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert seen.grads.keys() == theirs.keys()
    for name, grad in theirs.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(seen.grads[name] * 2, grad, rtol=1e-5, atol=1e-5 * scale)


def test_variants_train_through_lit_instruct_fit(tiny_model_dir, chat_file, tmp_path) -> None:
    from tests.test_config_swaps import fit

    args = [
        "--model.lora.use_dora",
        "true",
        "--model.lora.loraplus_lr_ratio",
        "4",
        "--model.lora.init",
        "gaussian",
    ]
    args += ["--model.lora.rank_pattern", '{"q_proj": 2}', "--trainer.accumulate_grad_batches", "2"]
    args += ["--model.adapter_dir", str(tmp_path / "adapter")]
    cli = fit(tiny_model_dir, chat_file, tmp_path, *args)
    assert cli.trainer.global_step == 2
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["use_dora"] and saved["rank_pattern"] == {"q_proj": 2}


def test_a_residual_init_resumes_on_the_same_residual(tiny_model_dir, chat_file, tmp_path) -> None:
    """Stopped after 2 of 4 steps and resumed: a checkpoint holds the adapter only, so the resumed
    module must rebuild the same residual base and initial adapter for its 2 further steps, its weights
    (residual base included) and the adapter it writes to equal the uninterrupted run's."""
    pissa = LoRAConfig(r=4, alpha=8, init="pissa", dropout=0.1)  # dropout: the RNG state matters too

    def fit(root: Path, *callbacks, ckpt_path=None) -> tuple[Recorder, InstructLoRAModule]:
        module, data = make(tiny_model_dir, chat_file, lora=pissa, batch_size=2)
        return recorded_fit(module, data, root, 4, *callbacks, ckpt_path=ckpt_path), module

    uninterrupted, whole = fit(tmp_path / "whole")
    every_2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path / "first", every_2, StopAfter(2))
    resumed, again = fit(tmp_path / "again", ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert_resumed_as_uninterrupted(resumed, uninterrupted, done=2)
    for (name, a), (_, b) in zip(whole.state_dict().items(), again.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    written = [
        load_file(m.write_adapter(tmp_path / n) / "adapter_model.safetensors")
        for m, n in ((whole, "a"), (again, "b"))
    ]
    assert written[0].keys() == written[1].keys()
    for name, tensor in written[0].items():
        torch.testing.assert_close(
            written[1][name], tensor, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    saved = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["init_lora_weights"]) == (8, 16, True)


def test_a_residual_init_trains_through_lit_instruct_fit(tiny_model_dir, chat_file, tmp_path) -> None:
    from tests.test_config_swaps import fit

    args = ["--model.lora.init", "pissa_niter_2", "--model.adapter_dir", str(tmp_path / "adapter")]
    assert fit(tiny_model_dir, chat_file, tmp_path, *args).trainer.global_step == 2
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["init_lora_weights"] is True and saved["r"] == 2 * 16  # plain LoRA of rank 2r
