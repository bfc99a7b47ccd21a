"""A base model taught a chat template whose markers its tokenizer lacks: ChatML's ``<|im_start|>`` /
``<|im_end|>`` added as tokens, the embedding grown, the new rows trained (or the whole embedding and
head), the adapter carrying the grown tokenizer, and merge / GGUF export holding the new rows.

The base: a tiny random Llama with a SentencePiece vocabulary of 400 pieces and no chat markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_instruct import InstructDataModule, InstructLoRAModule
from lit_instruct.templates import CHATML_TEMPLATE
from lit_instruct.vocabulary import resolve_new_tokens
from tests.helpers import trainer
from tests.sentencepiece_vocab import sentencepiece_tokenizer

CHATML_MARKERS = ["<|im_start|>", "<|im_end|>"]
ANSWERS = ["yes", "no", "maybe", "always", "never", "sometimes", "often", "rarely"]


def base_model(folder: Path, tied: bool = True) -> Path:
    sentencepiece_tokenizer("llama", folder)
    config = transformers.LlamaConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def conversations(path: Path) -> Path:
    records = [
        {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": a}]}
        for i, a in enumerate(ANSWERS * 4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def data_module(base: Path, data: Path, **kwargs) -> InstructDataModule:
    settings = {"chat_template": "chatml", "batch_size": 8, "max_seq_len": 64, "val_fraction": 0.0}
    return InstructDataModule(tokenizer=str(base), train_files=[str(data)], cache=False, **settings | kwargs)


def end_probability(module: InstructLoRAModule, batch: dict) -> float:
    """Mean probability of ``<|im_end|>`` where it is the next label (the end of each answer)."""
    end = module.hparams["added_tokens"].index("<|im_end|>")
    end_id = 400 + end
    with torch.no_grad():
        logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    probs = logits[:, :-1].float().softmax(-1)[..., end_id]
    return float(probs[targets == end_id].mean())


def test_the_template_markers_a_tokenizer_lacks_are_found(tokenizer, tmp_path) -> None:
    base = sentencepiece_tokenizer("llama", tmp_path / "base")
    assert resolve_new_tokens(base, [CHATML_TEMPLATE], "auto") == CHATML_MARKERS
    assert resolve_new_tokens(tokenizer, [CHATML_TEMPLATE], "auto") == []  # SmolLM2 holds them
    assert resolve_new_tokens(base, [CHATML_TEMPLATE], None) == []
    assert resolve_new_tokens(base, [CHATML_TEMPLATE], ["<s>", "<|x|>"]) == ["<|x|>"]  # <s>: one already
    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    gemma_like = (
        no_system + "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    )
    assert resolve_new_tokens(base, [gemma_like], "auto") == ["<start_of_turn>", "<end_of_turn>"]
    with pytest.raises(ValueError, match=r"set data\.new_tokens to a list"):
        resolve_new_tokens(base, ["{{ raise_exception('never') }}"], "auto")


@pytest.mark.parametrize(
    ("tied", "modules_to_save"),
    [(True, []), (False, []), (False, ["embed_tokens", "lm_head"])],
    ids=["tied-new-rows", "untied-new-rows", "untied-whole-modules"],
)
def test_a_base_model_learns_to_end_its_answers_and_exports_them(tied, modules_to_save, tmp_path) -> None:
    from lit_instruct.export.adapter import export_adapter, merge_adapter

    base = base_model(tmp_path / "base", tied)
    data = data_module(base, conversations(tmp_path / "chat.jsonl"))
    assert data.new_token_list() == CHATML_MARKERS
    lora = {"r": 4, "alpha": 8, "modules_to_save": modules_to_save}
    module = InstructLoRAModule(
        model=str(base), lora=lora, learning_rate=2e-2, warmup_steps=0, added_tokens=data.new_token_list()
    )
    trained = [n for n, p in module.named_parameters() if p.requires_grad and "lora_" not in n]
    assert trained and all(("trainable_tokens" in n) != bool(modules_to_save) for n in trained), trained
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert int((batch["labels"] == 401).sum()) == 8  # each answer ends with <|im_end|>, a trained label
    before = end_probability(module, batch)
    trainer(tmp_path, max_steps=12).fit(module, datamodule=data)
    after = end_probability(module, batch)
    assert after > 5 * before and after > 0.2, (before, after)

    # the fused loss read the trained rows: equal to the peft model's own forward(labels)
    loss_sum, count = module.loss_sum_and_count(batch)
    own = module.model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss
    torch.testing.assert_close(loss_sum / count, own, rtol=1e-5, atol=1e-6)

    adapter = module.saved_adapter
    assert len(AutoTokenizer.from_pretrained(adapter)) == 402
    clean = export_adapter(adapter, tmp_path / "clean")  # the PEFT folder keeps the grown tokenizer
    assert len(AutoTokenizer.from_pretrained(clean)) == 402
    assert (clean / "chat_template.jinja").read_text() == (adapter / "chat_template.jinja").read_text()
    merged = merge_adapter(adapter, tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert reloaded.get_input_embeddings().weight.shape[0] == 402
    ids = AutoTokenizer.from_pretrained(merged).apply_chat_template(
        [{"role": "user", "content": "Question 3?"}], tokenize=True, add_generation_prompt=True
    )
    inputs = torch.tensor([list(ids.get("input_ids", ids)) if hasattr(ids, "get") else ids])
    with torch.no_grad():
        expected = module.model(input_ids=inputs).logits
        torch.testing.assert_close(reloaded(input_ids=inputs).logits, expected, rtol=1e-5, atol=1e-5)


def test_the_gguf_of_a_grown_vocabulary_holds_the_new_tokens(tmp_path) -> None:
    from lit_instruct.export.gguf import export_gguf
    from tests.llama_cpp import contents

    base = base_model(tmp_path / "base")
    data = data_module(base, conversations(tmp_path / "chat.jsonl"))
    module = InstructLoRAModule(model=str(base), lora={"r": 4}, added_tokens=data.new_token_list())
    trainer(tmp_path, max_steps=1).fit(module, datamodule=data)
    metadata, tensors = contents(export_gguf(module.saved_adapter, tmp_path / "chat.gguf", "f32"))
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    assert tokens[400:] == CHATML_MARKERS and types[400:] == [3, 3]  # control tokens
    assert "<|im_start|>" in metadata["tokenizer.chat_template"]
    shape, _, rows = tensors["token_embd.weight"]
    assert shape == (64, 402)
    merged_rows = module.model.get_input_embeddings().weight.detach()
    torch.testing.assert_close(torch.from_numpy(rows.copy()).reshape(402, 64)[400:], merged_rows[400:])


def test_data_and_model_disagreeing_on_new_tokens_is_an_error(tmp_path) -> None:
    base = base_model(tmp_path / "base")
    data = data_module(base, conversations(tmp_path / "chat.jsonl"))
    module = InstructLoRAModule(model=str(base), lora={"r": 4})
    with pytest.raises(ValueError, match="adds the tokens"):
        trainer(tmp_path, max_steps=1).fit(module, datamodule=data)


def test_base_to_chat_yaml_links_the_data_tokens_to_the_model(tmp_path) -> None:
    from lit_instruct.cli import main

    base = base_model(tmp_path / "base")
    args = ["fit", "--config", str(Path(__file__).parents[1] / "configs" / "base-to-chat.yaml")]
    args += ["--model.model", str(base), "--data.chatterbot_categories", "null"]
    args += ["--data.train_files", f"[{conversations(tmp_path / 'chat.jsonl')}]", "--data.max_seq_len", "64"]
    args += ["--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.callbacks", "[]"]
    args += ["--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_progress_bar", "false"]
    main(args)
    grown = AutoTokenizer.from_pretrained(tmp_path / "run" / "adapter")
    assert grown.convert_ids_to_tokens([400, 401]) == CHATML_MARKERS
    # the fit's "try it" line: generate finds the adapter's base and grows its rows
    main(
        [
            "generate",
            "--adapter",
            str(tmp_path / "run" / "adapter"),
            "--prompt",
            "Hi?",
            "--max-new-tokens",
            "3",
        ]
    )
