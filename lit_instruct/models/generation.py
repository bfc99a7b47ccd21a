"""Answer a prompt with a model in memory: the chat template training used, greedy or sampled,
stopping at end-of-turn (``lit-instruct generate``, ``chat``, the module's ``predict_step``)."""

from __future__ import annotations

from typing import Any

import torch

from lit_instruct.contiguous_head import contiguous_head_input
from lit_instruct.templates import resolve_chat_template


def image_parts(messages: list[dict[str, Any]]) -> list[Any]:
    """The images of ``messages``' ``{"type": "image", "image": PIL image}`` parts, in order.

    Raises:
        ValueError: for an image part that holds no image.
    """
    images = []
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if part.get("type") == "image":
                if part.get("image") is None:
                    raise ValueError("an image part of the conversation holds no image")
                images.append(part["image"])
    return images


def prompt_inputs(
    tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None, processor: Any = None
) -> Any:
    """``messages`` rendered with the generation prompt and tokenized: through the vision-language
    model's ``processor`` (each image expanded to its tokens) when they hold images, else the
    tokenizer; without a template of its own, a processor renders with its own.

    Raises:
        ValueError: images without a processor.
    """
    images = image_parts(messages)
    if images and processor is None:
        raise ValueError("images need a vision-language model's processor")
    if processor is not None:
        chat_template = chat_template or getattr(processor, "chat_template", None)
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=resolve_chat_template(tokenizer, chat_template),
        tokenize=False,
        add_generation_prompt=True,
    )
    if images:
        return processor(text=[text], images=[images], add_special_tokens=False, return_tensors="pt")
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")


@torch.inference_mode()
def generate(
    model: Any,
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat_template: str | None = None,
    streamer: Any = None,
    images: list[Any] | None = None,
    processor: Any = None,
) -> str:
    """Answer ``prompt`` (a user message, or a list of chat messages) and return the answer text.

    ``temperature`` 0 is greedy decoding. Generation stops at the end-of-turn (EOS) token.
    ``streamer`` (e.g. ``transformers.TextStreamer``) receives tokens as they are produced.
    Messages may show images as ``{"type": "image", "image": PIL image}`` parts; ``images`` are
    shown before the last message's text. Images go through a vision-language model's ``processor``.
    """
    messages: list[dict[str, Any]] = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    )
    if images:
        last = messages[-1]
        parts: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
        messages[-1] = {**last, "content": [*parts, {"type": "text", "text": last["content"]}]}
    inputs = prompt_inputs(tokenizer, messages, chat_template, processor).to(model.device)
    sampling = {"temperature": temperature, "top_p": top_p} if temperature > 0 else {}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with contiguous_head_input(model):
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
            use_cache=True,
            do_sample=temperature > 0,
            streamer=streamer,
            **sampling,
        )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
