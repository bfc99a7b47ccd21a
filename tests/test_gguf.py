"""GGUF export: ``transformers`` loads the file back and its logits match the merged model's within
each storage type's tolerance; unsupported families are refused; the Ollama Modelfile."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_instruct.export.gguf import write_gguf
from lit_instruct.export.ollama import write_modelfile
from tests.families import build_family

pytestmark = pytest.mark.slow  # GGUF files written, read back and compared: `make test-fast` leaves it out

TEXT = "Hello! How are you today? I would like to hear a short story about a river and a mountain."
TOLERANCE = {  # max |logit diff| relative to the largest |logit|, and top-1 agreement over the text
    "f32": (1e-6, 1.0),
    "f16": (2e-3, 1.0),
    "bf16": (2e-2, 0.95),
    "q8_0": (3e-2, 0.95),
    "q4_0": (2.5e-1, 0.8),
}


def round_trip(model, tokenizer, folder: Path, quant: str, **kwargs) -> tuple[float, float, float]:
    """(max |diff| / max |logit|, mean |diff| / max |logit|, top-1 agreement) of the written file."""
    path = write_gguf(model, tokenizer, folder / f"model-{quant}.gguf", quant, **kwargs)
    back = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name).eval()
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected, got = model(ids).logits, back(ids).logits
    scale = float(expected.abs().max())
    diff = (got - expected).abs()
    agree = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
    return float(diff.max()) / scale, float(diff.mean()) / scale, agree


@pytest.mark.parametrize("quant", list(TOLERANCE))
def test_llama_round_trip_within_the_storage_types_tolerance(
    tiny_model_dir, tokenizer, tmp_path, quant
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    worst, _, agree = round_trip(model, tokenizer, tmp_path, quant)
    max_rel, min_agree = TOLERANCE[quant]
    assert worst <= max_rel and agree >= min_agree, (worst, agree)


def test_qwen2_round_trip(tokenizer, tmp_path) -> None:
    from transformers import Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    for quant in ("f32", "q8_0"):
        worst, _, agree = round_trip(model, tokenizer, tmp_path, quant, tokenizer_pre="qwen2")
        assert worst <= TOLERANCE[quant][0] and agree >= TOLERANCE[quant][1], (quant, worst, agree)


@pytest.mark.parametrize(("family", "message"), [("gemma", "not 'gemma'"), ("qwen2", "sliding-window")])
def test_unsupported_models_are_refused_and_nothing_is_written(tokenizer, tmp_path, family, message) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_family(family, len(tokenizer), tmp_path / family))
    with pytest.raises(ValueError, match=message):
        write_gguf(model, tokenizer, tmp_path / "out" / "m.gguf", "f16")
    assert not list((tmp_path / "out").glob("*"))


def test_an_unknown_vocabulary_needs_the_pre_tokenizer_name(tiny_model_dir, tokenizer, tmp_path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    other = copy.deepcopy(model.config)
    other.vocab_size = 1234
    model.config = other
    with pytest.raises(ValueError, match="unknown pre-tokenizer for a llama vocabulary of 1234"):
        write_gguf(model, tokenizer, tmp_path / "m.gguf")


def test_more_tokens_than_embedding_rows_are_refused(tiny_model_dir, tokenizer, tmp_path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    grown = copy.deepcopy(tokenizer)
    grown.add_tokens(["<new_token>"])
    with pytest.raises(ValueError, match="token ids up to 49152 but the model has 49152 embedding rows"):
        write_gguf(model, grown, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


GO_ACTION = re.compile(r"\{\{-? *(range \.Messages|end|\.Role|\.Content|if \.System|\.System) *-?\}\}")


def check_modelfile_syntax(text: str) -> dict[str, list[str]]:
    """Ollama's documented Modelfile format: one instruction per line (FROM, TEMPLATE, PARAMETER,
    SYSTEM...), values quoted, multi-line values in triple quotes; TEMPLATE uses Go template actions."""
    instructions: dict[str, list[str]] = {}
    for match in re.finditer(
        r'^(FROM|TEMPLATE|PARAMETER|SYSTEM) (""".*?"""|"[^"\n]*"|\S+(?: "[^"\n]*")?)$', text, re.M | re.S
    ):
        instructions.setdefault(match.group(1), []).append(match.group(2))
    assert sum(len(v) for v in instructions.values()) == len(re.findall(r"^[A-Z]+ ", text, re.M))
    template = instructions["TEMPLATE"][0].strip('"')
    assert template.count("{{") == template.count("}}") == len(GO_ACTION.findall(template))
    return instructions


def fill_go_template(template: str, messages: list[dict[str, str]]) -> str:
    """The template's meaning for the one construct it uses: ``{{- range .Messages }}...{{ end }}``."""
    head, rest = template.split("{{- range .Messages }}")
    body, tail = rest.split("{{ end }}")
    turns = "".join(
        body.replace("{{ .Role }}", m["role"]).replace("{{ .Content }}", m["content"]) for m in messages
    )
    return head + turns + tail


def test_the_modelfile_reproduces_the_training_template(tokenizer, tmp_path) -> None:
    path = write_modelfile(tmp_path / "model.gguf", tokenizer)
    instructions = check_modelfile_syntax(path.read_text())
    assert instructions["FROM"] == ["./model.gguf"]
    assert instructions["PARAMETER"] == ['stop "<|im_end|>"']
    assert instructions["SYSTEM"] == [
        '"""You are a helpful AI assistant named SmolLM, trained by Hugging Face"""'
    ]
    messages = [
        {"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    jinja = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True)
    assert fill_go_template(instructions["TEMPLATE"][0][3:-3], messages) == jinja  # SYSTEM fills the default


def test_a_template_ollama_cannot_reproduce_is_refused(tokenizer, tmp_path) -> None:
    from tests.test_templates import LLAMA3, family_tokenizer

    with pytest.raises(ValueError, match="looks like llama3 but renders differently"):
        write_modelfile(tmp_path / "m.gguf", family_tokenizer(tokenizer, "llama3"), LLAMA3)  # a date header
    with pytest.raises(ValueError, match="no Ollama template is known"):
        write_modelfile(tmp_path / "m.gguf", tokenizer, "alpaca")


@pytest.mark.e2e
def test_the_bundled_model_exports_to_gguf_and_ollama(smollm2_path, tmp_path) -> None:
    """SmolLM2 with an adapter (fresh: merged = base) through the CLI, q8_0, loaded back (each storage
    type's round trip: the tiny Llama's tests; this one is the real model and the command line)."""
    from lit_instruct.adapter_folder import save_adapter
    from lit_instruct.models.load import load_base_model
    from lit_instruct.models.lora import LoRAConfig, attach_lora

    adapter = save_adapter(
        attach_lora(load_base_model(str(smollm2_path)), LoRAConfig(r=4)), tmp_path / "adapter"
    )
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = reference(ids).logits
    quant = "q8_0"
    out = tmp_path / quant / "smollm2.gguf"
    args = [
        "export",
        "--adapter",
        str(adapter),
        "--out",
        str(out),
        "--gguf",
        "--quant",
        quant,
        "--ollama",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "lit_instruct", *args], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out.parent / "smollm2.Modelfile").is_file()
    back = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name).eval()
    with torch.no_grad():
        got = back(ids).logits
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) / scale <= TOLERANCE[quant][0]
    assert float((got.argmax(-1) == expected.argmax(-1)).float().mean()) >= TOLERANCE[quant][1]


def test_q4_0_keeps_the_tied_output_embedding_at_q8_0(tiny_model_dir, tokenizer, tmp_path) -> None:
    """As llama.cpp's quantizer: the output head (here the token embedding it is tied to) at Q8_0."""
    from tests.llama_cpp import contents

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    _, tensors = contents(write_gguf(model, tokenizer, tmp_path / "m.gguf", "q4_0"))
    kinds = {name: kind for name, (_, kind, _) in tensors.items()}
    assert kinds.pop("token_embd.weight") == "Q8_0"
    assert {kind for name, kind in kinds.items() if not name.endswith("norm.weight")} == {"Q4_0"}


def test_an_adapter_exports_the_template_it_was_trained_with(tiny_model_dir, chat_file, tmp_path) -> None:
    """Trained with ``data.chat_template: alpaca``: the adapter folder keeps it, and the GGUF carries it
    (not the tokenizer's ChatML) unless ``chat_template`` overrides it."""
    from lit_instruct.data.datamodule import InstructDataModule
    from lit_instruct.export.gguf import export_gguf
    from lit_instruct.templates import BUILTIN_TEMPLATES
    from tests.helpers import make, trainer
    from tests.llama_cpp import contents

    module, _ = make(tiny_model_dir, chat_file)
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir), train_files=[str(chat_file)], val_fraction=0.0, batch_size=2,
        chat_template="alpaca", cache=False,
    )  # fmt: skip
    module.hparams["adapter_dir"] = str(tmp_path / "run" / "adapter")
    trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(module, datamodule=data)
    adapter = tmp_path / "run" / "adapter"
    assert (adapter / "chat_template.jinja").read_text() == BUILTIN_TEMPLATES["alpaca"]
    metadata, _ = contents(export_gguf(adapter, tmp_path / "alpaca.gguf", "f32"))
    assert metadata["tokenizer.chat_template"] == BUILTIN_TEMPLATES["alpaca"]
    assert metadata["general.name"] == f"{tiny_model_dir.name}-run"
    custom = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    metadata, _ = contents(export_gguf(adapter, tmp_path / "custom.gguf", "f32", chat_template=custom))
    assert metadata["tokenizer.chat_template"] == custom
