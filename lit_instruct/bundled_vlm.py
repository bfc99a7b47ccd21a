"""The images demo's model, built offline: the bundled SmolLM2-135M-Instruct as the language model of
a LLaVA, with a small vision tower (CLIP's layout) and projector initialised from a fixed seed.

Its vision side knows nothing until trained (``model.lora.vision: all`` adapts it): it is there to
run the whole vision-language path on a CPU in minutes (``configs/vlm.yaml``), not to see. The
tokenizer gains one token, ``<image>`` (its embedding row the mean of the others: the processor
replaces it with image features before the decoder reads it); the chat template is SmolLM2's, with
each image shown as ``<image>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_instruct.io import atomic_directory

VISION_NAME = "smollm2-135m-vision"
IMAGE_SIZE = 56
PATCH_SIZE = 14
SEED = 0
READY_MARKER = "lit_instruct_prepared"
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
"""SmolLM2's template (its default system prompt included), reading turns as lists of parts too."""


def prepare_smollm2_vision(target: Path, smollm2: Path, force: bool = False) -> Path:
    """Build the model into ``target`` once (atomically) from the prepared SmolLM2 at ``smollm2``."""
    if (target / READY_MARKER).is_file() and not force:
        return target

    import torch
    import transformers

    t: Any = transformers  # its config and model classes take keyword arguments the stubs do not list

    tokenizer = t.AutoTokenizer.from_pretrained(smollm2)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = t.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    text_config = text.config.to_dict()
    text_config["vocab_size"] = len(tokenizer)
    vision_config = {
        "model_type": "clip_vision_model",
        "hidden_size": 192,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
    }
    config = t.LlavaConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = t.LlavaForConditionalGeneration(config)
    embeddings = text.get_input_embeddings().weight.detach()
    grown = torch.cat([embeddings, embeddings.mean(dim=0, keepdim=True)])
    state = {f"model.language_model.{k.removeprefix('model.')}": v for k, v in text.state_dict().items()}
    state["model.language_model.embed_tokens.weight"] = grown
    state.pop("model.language_model.lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(k.startswith("model.language_model") for k in missing):
        raise RuntimeError(f"SmolLM2's weights do not fit the LLaVA layout: {unexpected or missing}")
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    processor = t.LlavaProcessor(
        image_processor=t.LlavaImageProcessor(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        ),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        patch_size=PATCH_SIZE,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
    )
    with atomic_directory(target) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        processor.save_pretrained(staging)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(staging)
        (staging / READY_MARKER).write_text(f"built from {smollm2} with seed {SEED}\n")
    return target
