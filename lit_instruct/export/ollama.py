"""An Ollama ``Modelfile`` beside an exported GGUF: ``ollama create NAME -f Modelfile`` works.

Ollama prompts with its own (Go) template language, not the model's Jinja chat template. The formats
whose Go template is known are written (:data:`FORMATS`: ChatML and Llama 3), each checked against
the Jinja template first: the Go template, filled for a test conversation, must give exactly what the
Jinja template renders for it; any other template is refused rather than written wrong. The system
prompt the Jinja template adds by itself (SmolLM2 has one) becomes the ``SYSTEM`` default, and the
end-of-turn marker the ``stop`` parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_instruct.templates import resolve_chat_template


@dataclass(frozen=True)
class OllamaFormat:
    """A chat format: a marker that recognises its Jinja template, its Go template (built from one
    range over ``.Messages``, see :func:`fill`) and its stop marker."""

    marker: str
    template: str
    stop: str


FORMATS = {
    "chatml": OllamaFormat(
        marker="<|im_start|>",
        template="{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
        "<|im_start|>assistant\n",
        stop="<|im_end|>",
    ),
    "llama3": OllamaFormat(
        marker="<|start_header_id|>",
        template="<|begin_of_text|>{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
        "{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        stop="<|eot_id|>",
    ),
}
PROBE = [
    {"role": "system", "content": "Sys."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
]
RANGE, END = "{{- range .Messages }}", "{{ end }}"


def fill(template: str, messages: list[dict[str, str]]) -> str:
    """What Ollama renders from one of :data:`FORMATS`' templates for ``messages``."""
    head, rest = template.split(RANGE)
    body, tail = rest.split(END)
    turns = (body.replace("{{ .Role }}", m["role"]).replace("{{ .Content }}", m["content"]) for m in messages)
    return head + "".join(turns) + tail


def _render(tokenizer: Any, template: str, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def ollama_format(tokenizer: Any, chat_template: str | None = None) -> tuple[OllamaFormat, str | None]:
    """The known format that reproduces the chat template exactly, and the default system prompt
    the template adds when a conversation has none.

    Raises:
        ValueError: when no known format reproduces the template.
    """
    template = resolve_chat_template(tokenizer, chat_template)
    for name, fmt in FORMATS.items():
        if fmt.marker not in template:
            continue
        jinja, ours = _render(tokenizer, template, PROBE), fill(fmt.template, PROBE)
        if jinja != ours:
            raise ValueError(
                f"the chat template looks like {name} but renders differently than Ollama's {name} template "
                f"would:\n  jinja:  {jinja!r}\n  ollama: {ours!r}\nwrite the Modelfile's TEMPLATE by hand"
            )
        opening = fill(fmt.template, [{"role": "system", "content": "\0"}]).split("\0")[0]
        alone = _render(tokenizer, template, PROBE[1:2])  # no system turn given: does it add one?
        found = re.match(re.escape(opening) + r"(.*?)" + re.escape(fmt.stop), alone, re.S)
        return fmt, found.group(1) if found else None
    raise ValueError(
        f"no Ollama template is known for this chat template (known: {sorted(FORMATS)}); write the "
        "Modelfile's TEMPLATE by hand (https://github.com/ollama/ollama/blob/main/docs/template.md)"
    )


def write_modelfile(gguf_file: str | Path, tokenizer: Any, chat_template: str | None = None) -> Path:
    """Write ``<gguf stem>.Modelfile`` next to ``gguf_file`` (FROM, TEMPLATE, PARAMETER stop, SYSTEM):
    one per GGUF, so exports into one folder keep theirs."""
    gguf_file = Path(gguf_file)
    fmt, system = ollama_format(tokenizer, chat_template)
    lines = [f"FROM ./{gguf_file.name}", f'TEMPLATE """{fmt.template}"""', f'PARAMETER stop "{fmt.stop}"']
    if system:
        lines.append(f'SYSTEM """{system}"""')
    path = gguf_file.with_name(f"{gguf_file.stem}.Modelfile")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
