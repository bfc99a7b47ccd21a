"""QLoRA on an NF4 base, memory accounting, adapter export and merge, and generation."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from lit_instruct.errors import ConfigError
from lit_instruct.export.adapter import export_adapter, merge_adapter
from lit_instruct.infer.generate import generate, load_for_generation
from lit_instruct.models.load import QuantizationConfig, load_base_model, parameter_bytes
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import make, trainer

needs_bitsandbytes = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="QLoRA needs bitsandbytes (the qlora extra)"
)
NF4_FP32 = QuantizationConfig(method="nf4", double_quant=True, compute_dtype="float32")


def batch_of(tokenizer) -> dict[str, torch.Tensor]:
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@needs_bitsandbytes
def test_nf4_base_stays_close_to_the_fp32_base(tiny_model_dir, tokenizer) -> None:
    batch = batch_of(tokenizer)
    with torch.no_grad():
        full = load_base_model(str(tiny_model_dir)).eval()(**batch).logits.log_softmax(-1)
        nf4 = (
            load_base_model(str(tiny_model_dir), quantization=NF4_FP32).eval()(**batch).logits.log_softmax(-1)
        )
    # 4-bit weights: log-probabilities agree to 0.15 nats at worst and 0.03 on average on this 2-layer
    # model (measured: 0.087 and 0.013); a wrong dequantization misses by whole nats.
    error = (nf4 - full).abs()
    assert 0 < error.max() < 0.15
    assert error.mean() < 0.03


@needs_bitsandbytes
def test_4bit_layers_keep_their_trainable_layout_after_eval_forwards(
    tiny_model_dir, tokenizer, monkeypatch
) -> None:
    """bitsandbytes >= 0.49 repacks 4-bit weights at the first no-grad eval forward on a CPU it finds
    AVX512-BF16 on (our build checks run such forwards) into a layout with no input gradient: the
    gradient through the base layer must still be the dequantized weight's. bitsandbytes asks the CPU
    once per layer, when it is built: here it is told yes, so the repacking path is live on any CPU."""
    import bitsandbytes
    from bitsandbytes.functional import dequantize_4bit

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)
    assert bitsandbytes.nn.Linear4bit(64, 64).support_avx512bf16_for_cpu  # what every layer is built with
    model = load_base_model(str(tiny_model_dir), quantization=NF4_FP32).eval()
    with torch.no_grad():
        model(**batch_of(tokenizer))
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float32 and layer.weight.shape[1] == 1  # packed in the storage dtype

    x = torch.randn(3, layer.in_features, requires_grad=True)
    reference = x.detach().clone().requires_grad_()
    layer.train()(x).square().sum().backward()
    dense = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    (reference @ dense.T).square().sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, reference.grad)


@needs_bitsandbytes
def test_a_4bit_layout_we_cannot_train_is_refused_by_name(tiny_model_dir) -> None:
    from lit_instruct.models.four_bit import bitsandbytes_version, check_training_layout

    model = load_base_model(str(tiny_model_dir), quantization=NF4_FP32)
    check_training_layout(model, torch.float32)
    weight = model.model.layers[1].self_attn.o_proj.weight
    weight.data = weight.data.view(torch.uint8)  # the bytes bitsandbytes 0.49+ repacks to on the CPU
    expected = (
        rf"bitsandbytes {bitsandbytes_version()}: the 4-bit weight model.layers.1.self_attn.o_proj.weight "
        r"\(and 0 more\) is stored as torch.uint8 .* install bitsandbytes>="
    )
    with pytest.raises(RuntimeError, match=expected):
        check_training_layout(model, torch.float32)
    with pytest.raises(RuntimeError, match="no layer of the model was quantized"):
        check_training_layout(load_base_model(str(tiny_model_dir)), torch.float32)


def test_a_bitsandbytes_too_old_for_the_compute_dtype_storage_is_refused_at_load(monkeypatch) -> None:
    import lit_instruct.models.four_bit as four_bit

    monkeypatch.setattr(four_bit, "version", lambda name: "0.46.1")  # what the environment would report
    with pytest.raises(
        ConfigError,
        match=r"^model\.quantization\.method: 4-bit \(QLoRA\) bases need bitsandbytes>=0\.47.*found 0\.46\.1",
    ):
        load_base_model("unused", quantization=NF4_FP32)


@needs_bitsandbytes
def test_qlora_trains_only_the_adapters_on_cpu(tiny_model_dir, chat_file, tmp_path) -> None:
    module, data = make(tiny_model_dir, chat_file, quantization=NF4_FP32)
    data.batch_size = 6
    data.setup("fit")
    base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    packed = [p for p in module.parameters() if type(p).__name__ == "Params4bit"]
    assert packed and all(p.dtype == torch.float32 for p in packed)  # 4-bit, packed in the compute dtype
    assert all(p.numel() * p.element_size() * 2 == p.quant_state.shape.numel() for p in packed)  # 4 bits each

    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        before = module.loss_sum_and_count(batch)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer(tmp_path, max_steps=20, limit_val_batches=0, logger=logger).fit(module, datamodule=data)
    with torch.no_grad():
        after = module.loss_sum_and_count(batch)

    with open(Path(logger.log_dir) / "metrics.csv") as rows:
        logged = next(row for row in csv.DictReader(rows) if row["model/base_bytes"])
    expected = parameter_bytes(module.model)
    assert float(logged["model/base_bytes"]) == expected["total"]
    assert 0 < float(logged["model/quantized_linear_bytes"]) == expected["quantized_linear"]
    assert float(logged["model/trainable_params"]) == sum(p.numel() for p in lora.values())
    assert float(logged["model/lora_linear_adapted"]) == float(logged["model/lora_linear_asked"]) == 2 * 7

    assert after[1] == before[1]
    # On this random 2-layer model LoRA r=4 moves the loss slowly (fp32 LoRA: 10.82 -> 10.23 nats,
    # NF4: 10.82 -> 10.29); a QLoRA that does not learn stays within a few hundredths.
    assert after[0] / after[1] < before[0] / before[1] - 0.3
    params = dict(module.named_parameters())
    # byte for byte: 4-bit codes packed in float32 storage can read as NaN, which never equals itself
    assert all(torch.equal(params[n].view(torch.uint8), p.view(torch.uint8)) for n, p in base.items())
    assert all(not torch.equal(params[n], p) for n, p in lora.items())


@pytest.mark.e2e
@needs_bitsandbytes
def test_smollm2_nf4_memory(smollm2_path) -> None:
    fp32_model = load_base_model(str(smollm2_path))
    full = parameter_bytes(fp32_model)
    linear_fp32 = sum(
        4 * m.weight.numel()
        for name, m in fp32_model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in name
    )
    quantized = parameter_bytes(
        load_base_model(str(smollm2_path), quantization=QuantizationConfig("nf4", True, "bfloat16"))
    )
    assert linear_fp32 == 30 * 4 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)  # q,o; k,v; gate,up,down
    assert quantized["quantized_linear"] <= 0.15 * linear_fp32
    assert quantized["total"] <= 0.25 * full["total"]


def trained_adapter(tiny_model_dir, chat_file, tmp_path, **kwargs) -> Path:
    module, data = make(tiny_model_dir, chat_file, **kwargs)
    trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(module, datamodule=data)
    return tmp_path / "adapter"


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch).logits


def test_merged_model_equals_base_plus_adapter(tiny_model_dir, chat_file, tmp_path, tokenizer) -> None:
    adapter = trained_adapter(tiny_model_dir, chat_file, tmp_path)
    merged_dir = merge_adapter(adapter, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "tokenizer.json").is_file()
    combined = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    batch = batch_of(tokenizer)
    torch.testing.assert_close(logits(merged, batch), logits(combined, batch), atol=1e-5, rtol=0)


@needs_bitsandbytes
def test_nf4_trained_adapter_merges_into_the_full_precision_base(
    tiny_model_dir, chat_file, tmp_path, tokenizer
) -> None:
    adapter = trained_adapter(tiny_model_dir, chat_file, tmp_path, quantization=NF4_FP32)
    merged = AutoModelForCausalLM.from_pretrained(merge_adapter(adapter, tmp_path / "merged"))
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    combined = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    batch = batch_of(tokenizer)
    torch.testing.assert_close(logits(merged, batch), logits(combined, batch), atol=1e-5, rtol=0)


def test_export_writes_a_clean_adapter_and_refuses_non_finite_weights(tiny_model_dir, chat_file, tmp_path):
    adapter = trained_adapter(tiny_model_dir, chat_file, tmp_path)
    (adapter / "optimizer.pt").write_bytes(b"not part of an adapter")
    out = export_adapter(adapter, tmp_path / "clean")
    kept = [".lit-instruct", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja"]
    assert sorted(p.name for p in out.iterdir()) == kept
    assert (out / "chat_template.jinja").read_text() == (adapter / "chat_template.jinja").read_text()
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)

    weights = load_file(adapter / "adapter_model.safetensors")
    name = sorted(weights)[0]
    weights[name][0, 0] = float("nan")
    save_file(weights, adapter / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=f"tensor '{name}' contains NaN or Inf"):
        export_adapter(adapter, tmp_path / "clean")
    assert sorted(p.name for p in out.iterdir()) == kept
    assert torch.isfinite(load_file(out / "adapter_model.safetensors")[name]).all()


class IdCollector:
    """A streamer that keeps the generated token ids."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids += value.flatten().tolist()

    def end(self) -> None:
        pass


@pytest.mark.e2e
def test_generate_stops_at_end_of_turn(smollm2_path) -> None:
    model, tokenizer = load_for_generation(str(smollm2_path))
    collector = IdCollector()
    answer = generate(
        model, tokenizer, "What is the capital of France?", max_new_tokens=64, streamer=collector
    )
    assert collector.ids[-1] == tokenizer.eos_token_id  # <|im_end|>
    assert len(collector.ids) < 64
    assert "Paris" in answer and "<|im_" not in answer


@pytest.mark.slow
def test_cli_export_and_generate_run(tiny_model_dir, chat_file, tmp_path) -> None:
    adapter = trained_adapter(tiny_model_dir, chat_file, tmp_path)
    run = [sys.executable, "-m", "lit_instruct"]
    done = subprocess.run(
        [*run, "export", "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--merge"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "llama"
    done = subprocess.run(
        [
            *run,
            "generate",
            "--model",
            str(tiny_model_dir),
            "--adapter",
            str(adapter),
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    model, tokenizer = load_for_generation(str(tiny_model_dir), str(adapter))
    expected = generate(model, tokenizer, "Hi", max_new_tokens=4)
    assert expected and done.stdout.strip() == expected.strip()


@needs_bitsandbytes
def test_module_hparams_are_plain_data(tiny_model_dir, chat_file) -> None:
    """Checkpoints store the hyperparameters as plain YAML-able data, and they rebuild the module."""
    module, _ = make(tiny_model_dir, chat_file, quantization=NF4_FP32)
    assert module.hparams["quantization"] == {
        "method": "nf4",
        "double_quant": True,
        "compute_dtype": "float32",
    }
    plain = yaml.safe_load(yaml.safe_dump(dict(module.hparams)))  # safe_dump refuses Python objects
    rebuilt = InstructLoRAModule(**plain)
    assert rebuilt.quantization == module.quantization and rebuilt.lora_config == module.lora_config
    assert parameter_bytes(rebuilt.model) == parameter_bytes(module.model)


def test_generation_preview_answers_fixed_prompts_after_each_validation(tiny_model_dir, chat_file, tmp_path):
    from lit_instruct.callbacks import GenerationPreview

    module, data = make(tiny_model_dir, chat_file)
    preview = GenerationPreview(prompts=["Say hello.", "2+2?"], max_new_tokens=3)
    fit = trainer(tmp_path, max_steps=2, val_check_interval=1, callbacks=[preview], num_sanity_val_steps=1)
    fit.fit(module, datamodule=data)
    assert [(step, prompt) for step, prompt, _ in preview.history] == [
        (1, "Say hello."),
        (1, "2+2?"),
        (2, "Say hello."),
        (2, "2+2?"),
    ]  # no entry for the sanity check
    written = (tmp_path / "generations.txt").read_text()
    assert written.count("[step 2] 2+2?") == 1
    with pytest.raises(ValueError, match="at least one prompt"):
        GenerationPreview(prompts=[])


def test_each_rank_quantizes_onto_its_own_device() -> None:
    """The placement rule of 4-bit bases: the rank's GPU (LOCAL_RANK, set by Lightning's launcher and
    torchrun), the CPU where there is no GPU; never every rank on cuda:0."""
    from lit_instruct.models.load import quantization_device

    assert quantization_device({}, cuda_devices=0) == "cpu"
    assert quantization_device({"LOCAL_RANK": "1"}, cuda_devices=0) == "cpu"
    assert quantization_device({}, cuda_devices=2) == "cuda:0"
    assert [quantization_device({"LOCAL_RANK": str(r)}, cuda_devices=4) for r in range(4)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
    ]
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but only 2 CUDA devices"):
        quantization_device({"LOCAL_RANK": "2"}, cuda_devices=2)
    srun = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}  # node 1 of 2, its 2nd task
    assert quantization_device(srun, cuda_devices=4) == "cuda:1"
    assert quantization_device({"SLURM_NTASKS": "1", "SLURM_LOCALID": "1"}, cuda_devices=4) == "cuda:0"


@needs_bitsandbytes
def test_loftq_adapters_are_the_best_rank_r_fit_of_the_quantization_error(
    tiny_model_dir, chat_file, tokenizer, tmp_path
) -> None:
    """``init: loftq`` on an NF4 base: each ``s * B @ A`` is the best rank-r approximation of
    ``W - NF4(W)`` (its error is the norm of the dropped singular values: Eckart-Young), so the 4-bit
    model with its adapters is closer to the full-precision one; then it trains."""
    from bitsandbytes.functional import dequantize_4bit
    from peft.tuners.lora import Linear4bit
    from safetensors.torch import load_file

    from lit_instruct.models.lora import LoRAConfig

    module, data = make(
        tiny_model_dir, chat_file, lora=LoRAConfig(r=4, alpha=8, init="loftq"), quantization=NF4_FP32
    )
    full = load_file(tiny_model_dir / "model.safetensors")
    layers = [(n, m) for n, m in module.model.named_modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 14
    for name, layer in layers:
        error = full[name.removeprefix("base_model.model.") + ".weight"] - dequantize_4bit(
            layer.weight.data, layer.weight.quant_state
        )
        fitted = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        dropped = torch.linalg.svdvals(error)[4:]
        torch.testing.assert_close(
            torch.linalg.matrix_norm(error - fitted), dropped.norm(), rtol=1e-4, atol=1e-6
        )
    batch = batch_of(tokenizer)
    with torch.no_grad():
        reference = load_base_model(str(tiny_model_dir)).eval()(**batch).logits
        loftq = module.model.eval()(**batch).logits
        plain = load_base_model(str(tiny_model_dir), quantization=NF4_FP32).eval()(**batch).logits
    assert (loftq - reference).abs().mean() < (plain - reference).abs().mean()  # quantization error absorbed
    trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(module.train(), datamodule=data)


@needs_bitsandbytes
def test_loftq_trains_through_lit_instruct_fit(tiny_model_dir, chat_file, tmp_path) -> None:
    from tests.test_config_swaps import fit

    args = ["--model.lora.init", "loftq", "--model.quantization.method", "nf4"]
    args += ["--model.quantization.compute_dtype", "float32"]
    assert fit(tiny_model_dir, chat_file, tmp_path, *args).trainer.global_step == 2
