"""Tiny random vision-language models with processors, built offline: SmolLM2's tokenizer with each
family's image tokens, its image processor at a tiny size, a ChatML template that shows images as
the family's placeholder, and a vision tower, projector and decoder of a few layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def chatml_with_images(placeholder: str) -> str:
    """ChatML whose turns may be lists of parts, each image shown as ``placeholder``."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + placeholder + "{% "
        "elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _tokenizer(smollm2: Path, tokens: list[str], named: dict[str, str] | None = None) -> Any:
    from transformers import AutoTokenizer

    if named:
        return AutoTokenizer.from_pretrained(smollm2, extra_special_tokens=named)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


def _llava(smollm2: Path) -> tuple[Any, Any]:
    import transformers as t

    tok = _tokenizer(smollm2, ["<image>"])
    processor = t.LlavaProcessor(
        image_processor=t.LlavaImageProcessor(
            size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
        ),
        tokenizer=tok,
        chat_template=chatml_with_images("<image>"),
        patch_size=14,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
    )
    config = t.LlavaConfig(
        vision_config={"model_type": "clip_vision_model", **VISION, "image_size": 28, "patch_size": 14},
        text_config={"model_type": "llama", "vocab_size": len(tok), **TEXT},
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    return processor, t.LlavaForConditionalGeneration(config)


def _gemma3(smollm2: Path) -> tuple[Any, Any]:
    import transformers as t

    named = {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    }
    tok = _tokenizer(smollm2, [], named)
    processor = t.Gemma3Processor(
        image_processor=t.Gemma3ImageProcessor(size={"height": 28, "width": 28}),
        tokenizer=tok,
        chat_template=chatml_with_images("<start_of_image>"),
        image_seq_length=4,
    )
    config = t.Gemma3Config(
        text_config={"vocab_size": len(tok), **TEXT, "sliding_window": 8},
        vision_config={**VISION, "image_size": 28, "patch_size": 7, "vision_use_head": False},  # as Gemma 3's
        mm_tokens_per_image=4,
        image_token_id=tok.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_id=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_id=tok.convert_tokens_to_ids("<end_of_image>"),
    )
    return processor, t.Gemma3ForConditionalGeneration(config)


def _idefics_layout(smolvlm: bool) -> Callable[[Path], tuple[Any, Any]]:
    """Idefics3 or SmolVLM (its successor: the same layout, a processor that also takes videos)."""

    def build(smollm2: Path) -> tuple[Any, Any]:
        import transformers as t

        tok = _tokenizer(
            smollm2, ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
        )
        name = "SmolVLM" if smolvlm else "Idefics3"
        processor_class = getattr(t, f"{name}Processor")
        extra = {"video_processor": None} if smolvlm else {}
        processor = (images_only(processor_class) if smolvlm else processor_class)(
            image_processor=getattr(t, f"{name}ImageProcessor")(
                size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True
            ),
            tokenizer=tok,
            chat_template=chatml_with_images("<image>"),
            image_seq_len=4,
            **extra,
        )
        config = getattr(t, f"{name}Config")(
            text_config={"model_type": "llama", "vocab_size": len(tok), **TEXT},
            vision_config={**VISION, "image_size": 28, "patch_size": 7},
            scale_factor=2,
            image_token_id=tok.convert_tokens_to_ids("<image>"),
        )
        return processor, getattr(t, f"{name}ForConditionalGeneration")(config)

    return build


def images_only(cls: Any) -> Any:
    """Processor class ``cls`` without its video processor (which ``transformers`` builds only with
    torchvision), as :func:`lit_instruct.data.processor.images_only` loads it."""
    kept = [attribute for attribute in cls.get_attributes() if attribute != "video_processor"]
    return type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda _: list(kept))})


def _mistral3(smollm2: Path) -> tuple[Any, Any]:
    """Mistral 3: Pixtral's vision tower (2-D RoPE over patches of any image size), patches merged 2x2,
    each image as rows of ``[IMG]`` ended by ``[IMG_BREAK]``, the last by ``[IMG_END]``."""
    import transformers as t

    from lit_instruct.data.processor import processor_class

    tok = _tokenizer(smollm2, ["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    processor = processor_class("PixtralProcessor")(  # its module read without torchvision
        image_processor=t.PixtralImageProcessorPil(size={"longest_edge": 28}, patch_size=14),
        tokenizer=tok,
        chat_template=chatml_with_images("[IMG]"),
        patch_size=7,
        spatial_merge_size=2,
    )
    vision = {**VISION, "head_dim": 16, "image_size": 28, "patch_size": 7}
    config = t.Mistral3Config(
        vision_config={"model_type": "pixtral", **vision},
        text_config={"model_type": "mistral", "vocab_size": len(tok), **TEXT},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
    )
    return processor, t.Mistral3ForConditionalGeneration(config)


QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _qwen_vl(version: str) -> Callable[[Path], tuple[Any, Any]]:
    """Qwen2-VL, Qwen2.5-VL or Qwen3-VL: M-RoPE positions (three sections; Qwen3's interleaved),
    merged patches, Qwen2.5's windowed vision attention, Qwen3's deepstack features."""

    def build(smollm2: Path) -> tuple[Any, Any]:
        import transformers as t

        tok = _tokenizer(smollm2, QWEN_TOKENS)
        ids = {
            "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
            "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
            "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
            "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
        }
        patch = 16 if version == "3" else 14
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        vision = {
            "depth": 2,
            "num_heads": 2,
            "patch_size": patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }
        if version == "2":
            vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
            config_class, model_class, processor_class = (
                "Qwen2VLConfig",
                "Qwen2VLForConditionalGeneration",
                "Qwen2VLProcessor",
            )
        elif version == "2.5":
            vision.update(
                hidden_size=32,
                out_hidden_size=64,
                intermediate_size=64,
                window_size=56,
                fullatt_block_indexes=[1],
            )
            config_class, model_class, processor_class = (
                "Qwen2_5_VLConfig",
                "Qwen2_5_VLForConditionalGeneration",
                "Qwen2_5_VLProcessor",
            )
        else:
            rope["mrope_interleaved"] = True
            vision.update(
                hidden_size=32,
                out_hidden_size=64,
                intermediate_size=64,
                deepstack_visual_indexes=[1],
                num_position_embeddings=16,
            )
            config_class, model_class, processor_class = (
                "Qwen3VLConfig",
                "Qwen3VLForConditionalGeneration",
                "Qwen3VLProcessor",
            )
        processor = images_only(getattr(t, processor_class))(
            image_processor=t.Qwen2VLImageProcessor(
                min_pixels=(2 * patch) ** 2, max_pixels=(4 * patch) ** 2, patch_size=patch
            ),
            tokenizer=tok,
            chat_template=chatml_with_images("<|vision_start|><|image_pad|><|vision_end|>"),
        )
        config = getattr(t, config_class)(
            text_config={"vocab_size": len(tok), **TEXT, "rope_parameters": rope}, vision_config=vision, **ids
        )
        return processor, getattr(t, model_class)(config)

    return build


VISION_FAMILIES: dict[str, Callable[[Path], tuple[Any, Any]]] = {
    "llava": _llava,
    "gemma3": _gemma3,
    "idefics3": _idefics_layout(smolvlm=False),
    "smolvlm": _idefics_layout(smolvlm=True),
    "qwen2_vl": _qwen_vl("2"),
    "qwen2_5_vl": _qwen_vl("2.5"),
    "qwen3_vl": _qwen_vl("3"),
    "mistral3": _mistral3,
}
"""Every family whose processor ``transformers`` builds here (Llama 4's image processor needs
torchvision, which does not install beside this torch; Qwen-VL's and SmolVLM's processors only for
videos, left out; Pixtral's processor module only for a helper its PIL module also has)."""
DECODER_FAMILY = {
    "llava": "llama",
    "idefics3": "llama",
    "smolvlm": "llama",
    "qwen2_vl": "qwen2",
    "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "gemma3": "gemma3",
    "mistral3": "mistral",
}
"""The text family (of ``tests/families.py``) of each vision-language family's decoder: the support
matrix's multimodal column."""
NO_LINEAR_PROJECTOR = {"gemma3"}
"""Families whose projector has no linear layer (Gemma 3's is a weight matrix and a norm), which
``model.lora.vision: projector`` refuses."""
LABELS = {
    "llava": "LLaVA",
    "gemma3": "Gemma 3",
    "idefics3": "Idefics3 (image splitting)",
    "smolvlm": "SmolVLM",
    "qwen2_vl": "Qwen2-VL (M-RoPE)",
    "qwen2_5_vl": "Qwen2.5-VL (windowed vision attention)",
    "qwen3_vl": "Qwen3-VL (interleaved M-RoPE, deepstack)",
    "mistral3": "Mistral 3 (Pixtral: 2-D RoPE, image rows and breaks)",
}


def build_vision_family(name: str, smollm2: Path, path: Path) -> Path:
    """Save a tiny random vision-language model of family ``name`` and its processor to ``path``."""
    torch.manual_seed(0)
    processor, model = VISION_FAMILIES[name](smollm2)
    with torch.no_grad():  # a weight that starts at zero (Gemma 3's projector) cuts the image's path
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def write_images(folder: Path) -> dict[str, Path]:
    """A few small PNGs of different sizes and colours."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    shapes = {
        "red": ((40, 30), (220, 20, 20)),
        "blue": ((30, 44), (20, 40, 230)),
        "green": ((64, 64), (30, 200, 40)),
    }
    paths = {}
    for name, (size, colour) in shapes.items():
        image = Image.new("RGB", size, colour)
        for x in range(0, size[0], 5):  # a pattern, so that patches differ
            image.putpixel((x, x % size[1]), (255, 255, 255))
        paths[name] = folder / f"{name}.png"
        image.save(paths[name])
    return paths
