"""InstructLoRAModule with a real Trainer on a tiny random Llama."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.models.fused_lora import fuse_lora
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import make, trainer


def test_only_lora_weights_change_and_the_adapter_round_trips(tiny_model_dir, chat_file, tmp_path) -> None:
    module, data = make(tiny_model_dir, chat_file)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer(tmp_path, limit_val_batches=0).fit(module, datamodule=data)

    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    lora = {n for n in before if "lora_" in n}
    assert changed == lora  # every adapter weight moved, nothing else did
    assert all(p.requires_grad == ("lora_" in n) for n, p in module.named_parameters())

    adapter = tmp_path / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter).eval()
    fuse_lora(reloaded)  # the module's own layers, so that equal weights give bit-equal logits
    module.model.eval()
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        ours = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        theirs = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_validation_reports_the_token_weighted_loss(tiny_model_dir, chat_file, tmp_path) -> None:
    module, data = make(tiny_model_dir, chat_file)
    data.eval_batch_size = 4  # two uneven batches: 4 samples, then 2
    (metrics,) = trainer(tmp_path).validate(module, datamodule=data, verbose=False)

    total, count = 0.0, 0
    with torch.no_grad():
        for sample in data.val_samples:  # one sample at a time, summed with transformers' own CE
            ids = torch.tensor([sample.input_ids])
            labels = torch.tensor([sample.labels])
            logits = module.model(input_ids=ids).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum"))
            count += sample.num_targets
    assert metrics["val/tokens"] == count
    torch.testing.assert_close(metrics["val/loss"], total / count, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        metrics["val/ppl"], float(torch.tensor(total / count).exp()), rtol=1e-5, atol=0
    )


def test_checkpoints_hold_only_trainable_weights_and_reload(tiny_model_dir, chat_file, tmp_path) -> None:
    module, data = make(tiny_model_dir, chat_file)
    fit = trainer(tmp_path, enable_checkpointing=True, limit_val_batches=0)
    fit.fit(module, datamodule=data)
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert state and all("lora_" in k for k in state)
    assert set(state) == {n for n, p in module.named_parameters() if p.requires_grad}

    restored = InstructLoRAModule.load_from_checkpoint(ckpt, weights_only=True)
    for name, tensor in module.trainable_state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor)

    # Loading stays strict for the adapter: a checkpoint missing one of its weights is refused.
    damaged = torch.load(ckpt, map_location="cpu", weights_only=True)
    lost = sorted(damaged["state_dict"])[0]
    del damaged["state_dict"][lost]
    torch.save(damaged, tmp_path / "damaged.ckpt")
    with pytest.raises(RuntimeError, match=lost.replace(".", r"\.")):
        InstructLoRAModule.load_from_checkpoint(tmp_path / "damaged.ckpt", weights_only=True)


def test_duplicates_are_dropped_before_the_seeded_split(tiny_model_dir, tmp_path) -> None:
    rows = [{"prompt": f"Question {i}?", "completion": f"Answer {i}."} for i in range(10)]
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:5]))
    splits = []
    for _ in range(2):
        data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(path)], val_fraction=0.3)
        data.setup("fit")
        splits.append([s.source for s in data.val_samples])
        assert data.counts["train"]["dropped_duplicate"] == 5
        assert len(data.train_samples) == 7 and len(data.val_samples) == 3
        train_ids = {tuple(s.input_ids) for s in data.train_samples}
        assert not train_ids & {tuple(s.input_ids) for s in data.val_samples}
    assert splits[0] == splits[1]  # the split depends on split_seed only


def test_trainer_predict_answers_as_the_saved_adapter_does(tiny_model_dir, chat_file, tmp_path) -> None:
    """Generation from the module in memory (fused LoRA layers, the data's chat template) equals the
    adapter written to disk, loaded afresh into peft's own layers, greedy token for token."""
    from torch.utils.data import DataLoader

    from lit_instruct.infer.generate import generate, load_for_generation

    module, data = make(tiny_model_dir, chat_file, learning_rate=5e-2, warmup_steps=0)
    fit = trainer(tmp_path, max_steps=3, limit_val_batches=0)
    fit.fit(module, datamodule=data)
    prompts = ["Hello there", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    module.predict_max_new_tokens = 12
    answers = fit.predict(module, dataloaders=DataLoader(prompts, batch_size=2, collate_fn=list))

    model, tokenizer = load_for_generation(str(tiny_model_dir), str(module.saved_adapter))
    template = data.training_chat_template()
    expected = [generate(model, tokenizer, p, max_new_tokens=12, chat_template=template) for p in prompts]
    assert answers == [expected] and all(expected)
    batch = tokenizer("Hello there", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(module(**batch).logits, model(**batch).logits, rtol=1e-5, atol=1e-5)
