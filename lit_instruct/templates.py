"""Chat templates lit-instruct ships, and which template renders a conversation.

``data.chat_template`` takes a Jinja template, a file holding one, or the name of one of these:

* ``alpaca``: the alpaca prompt (``### Instruction:`` / ``### Response:``), for tokenizers without a
  template.
* ``chatml``: plain ChatML (``<|im_start|>role ... <|im_end|>``), no default system prompt: a base
  model taught to chat.
* ``chatml-tools``: ChatML (``<|im_start|>role ... <|im_end|>``, SmolLM2's and Qwen's markers) that
  also shows what the plain ChatML templates drop: the tools offered (in the system turn, as
  Qwen2.5 and Hermes do), the assistant's tool calls (``<tool_call>`` JSON), tool results
  (``<tool_response>`` in a user turn) and reasoning (``<think>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_instruct.errors import ConfigError

ALPACA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n"
    "{% else %}{{ message['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
)
"""The built-in alpaca-style prompt template (``chat_template: alpaca``)."""

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)

CHATML_TOOLS_TEMPLATE = (
    "{% set has_system = messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if has_system %}{{ messages[0]['content'] }}\n\n{% endif %}" + _TOOLS_PREAMBLE + "<|im_end|>\n"
    "{% elif has_system %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not loop.first %}{{ raise_exception('a system message may only come first') }}{% endif %}"
    "{% elif message['role'] == 'user' %}<|im_start|>user\n{{ message['content'] }}<|im_end|>\n"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if message['reasoning_content'] %}"
    "<think>\n{{ message['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with tools, tool calls, tool results and reasoning shown (``chat_template: chatml-tools``)."""

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Plain ChatML, no default system prompt (``chat_template: chatml``): for teaching a base model to chat
(its markers become new tokens: ``data.new_tokens``)."""

BUILTIN_TEMPLATES = {
    "alpaca": ALPACA_CHAT_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
    "chatml-tools": CHATML_TOOLS_TEMPLATE,
}


def resolve_chat_template(tokenizer: Any, override: str | None = None) -> str:
    """The template that renders conversations: ``override`` (a Jinja template, or the name of one
    of :data:`BUILTIN_TEMPLATES`), else the tokenizer's own.

    Training and generation both call this, so a model is prompted the way it was trained.

    Raises:
        ValueError: when the tokenizer has no chat template and none is given.
    """
    if override in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[override]
    template = override or tokenizer.chat_template
    if not template:
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: set "
            f"data.chat_template to a Jinja chat template or one of {sorted(BUILTIN_TEMPLATES)}"
        )
    return template


def check_sandboxed(template: str, setting: str) -> str:
    """``template``, rendered once on a plain conversation in the sandbox ``transformers`` renders it
    in: one that reaches for what the sandbox forbids (``__class__``, ``__globals__``...) is refused
    before anything loads. Other failures (a template's own ``raise_exception``) are left to rendering.

    Raises:
        ConfigError: naming ``setting`` and the sandbox's complaint.
    """
    from jinja2.exceptions import SecurityError, TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        compiled = _compile_jinja_template(template)
        for messages in (SANDBOX_PROBE, SANDBOX_PROBE[1:]):
            compiled.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
    except SecurityError as unsafe:
        raise ConfigError(
            setting, f"the template does what Jinja's sandbox forbids ({unsafe}); it renders messages only"
        ) from None
    except TemplateSyntaxError as broken:
        raise ConfigError(
            setting, f"the template is no valid Jinja: line {broken.lineno}: {broken}"
        ) from None
    except Exception:  # the template's own refusal of the probe: rendering reports it
        pass
    return template


SANDBOX_PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi"},
    {"role": "user", "content": "Bye"},
]
"""A plain conversation the sandbox check renders (without its system turn as well)."""


def template_text(value: str | None, setting: str = "data.chat_template") -> str | None:
    """A chat template setting as the renderers take it: Jinja text and built-in names as they are,
    a file's path as the file's text.

    Raises:
        ConfigError: ``value`` is neither Jinja (no ``{{`` or ``{%``), nor a built-in name, nor a file.
    """
    if value is None or value in BUILTIN_TEMPLATES:
        return value
    if "{{" in value or "{%" in value:
        return check_sandboxed(value, setting)
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        return check_sandboxed(path.read_text(encoding="utf-8"), f"{setting} ({path})")
    raise ConfigError(
        setting,
        f"{value!r} is no file, no Jinja template (it has no {{{{ or {{%) and no built-in template "
        f"({', '.join(sorted(BUILTIN_TEMPLATES))})",
    )
