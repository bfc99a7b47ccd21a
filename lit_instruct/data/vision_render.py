"""Conversations with images -> token ids and labels, through the model's own processor.

The chat template renders each image as its placeholder (``<image>``, ``<|image_pad|>``,
``<start_of_image>``...) and the answers are found exactly as for text
(:class:`~lit_instruct.data.render.ChatRenderer`: character spans from the template's own
renderings). The processor then expands each placeholder into the image's tokens (their number
depends on the image's size) and tokenizes the expanded text; it reports where each placeholder
was and what replaced it (``return_text_replacement_offsets``), so every answer span is moved by
the characters the images before it added, and a token is labelled when it starts inside a moved
span: the rule of the text path, on the text the model sees.

Two checks run on every sample: the labelled tokens are the ones the text path labels (same ids,
same order: an expansion that changed how an answer tokenizes is refused), and no image lies inside
an answer (images are context; their tokens are never trained). A sample longer than
``max_seq_len`` is cut before the first image that would not fit whole, never through an image's
tokens (counted as ``truncated``, as any cut sample is); one whose first image does not fit is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_instruct.data.images import describe, open_image
from lit_instruct.data.records import DataError, Record
from lit_instruct.data.render import ChatRenderer, Encoding, MultiTurn, Sample, TrainOn
from lit_instruct.labels import IGNORE_INDEX


@dataclass(frozen=True)
class Expansion:
    """A rendered text as the processor expands it: its tokens and their character offsets in the
    expanded text, and each image's ``(start, end)`` characters before and after expansion."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    spans: list[tuple[int, int]]
    new_spans: list[tuple[int, int]]

    def moved(self, position: int) -> int:
        """Where character ``position`` of the rendered text is in the expanded one."""
        shift = 0
        for (start, end), (new_start, new_end) in zip(self.spans, self.new_spans, strict=True):
            if end <= position:
                shift += (new_end - new_start) - (end - start)
        return position + shift

    def image_tokens(self) -> list[tuple[int, int]]:
        """Each image's ``[first, last + 1)`` token range."""
        ranges = []
        for start, end in self.new_spans:
            inside = [k for k, (s, e) in enumerate(self.offsets) if s < end and e > start]
            ranges.append((inside[0], inside[-1] + 1) if inside else (0, 0))
        return ranges


class VisionRenderer(ChatRenderer):
    """A :class:`ChatRenderer` for a vision-language model: ``processor`` is its
    ``AutoProcessor`` (chat template, tokenizer, image processor); other arguments as there."""

    def __init__(
        self,
        processor: Any,
        max_seq_len: int,
        chat_template: str | None = None,
        multi_turn: MultiTurn = "auto",
        train_on: TrainOn = "answers",
    ) -> None:
        tokenizer = processor.tokenizer
        if chat_template is None:  # the processor's template shows images; the tokenizer's may not
            chat_template = getattr(processor, "chat_template", None)
        super().__init__(tokenizer, max_seq_len, chat_template, multi_turn, train_on)
        self.processor = processor
        image_token = getattr(processor, "image_token", None)
        if not isinstance(image_token, str) or not image_token:
            raise ValueError(f"{type(processor).__name__} names no image token: it cannot place images")
        self.image_token: str = image_token
        self.first_cut = 1 << 62  # the processor expands whole texts: render every sample whole

    def samples(self, record: Record) -> tuple[list[Sample], bool]:
        """As the text renderer's, but ``train_on: all`` labels every token except the images' (done
        in :meth:`_sample`, where their places are known)."""
        if record.text is not None:
            return super().samples(record)
        self._check_images(record)
        return self._answer_samples(record)

    def _check_images(self, record: Record) -> None:
        """Refuse an image in an answer: images are context (their tokens are never trained)."""
        shown = next((i for i, m in enumerate(record.messages) if m.images and m.role == "assistant"), None)
        if shown is not None:
            raise DataError(
                record.source,
                f"messages[{shown}]: an image is inside an answer; images are context (their tokens are "
                "never trained): put it in a user turn",
                reason="image_in_answer",
            )

    def expand(self, record: Record, text: str, images: list[str]) -> Expansion:
        """``text`` with its ``images`` as the processor expands and tokenizes it."""
        loaded = [open_image(reference) for reference in images]
        try:
            out = self.processor(
                text=[text],
                images=[loaded] if loaded else None,
                return_text_replacement_offsets=True,
                return_offsets_mapping=True,
                add_special_tokens=False,
            )
        except ValueError as error:  # an image it cannot take (Qwen-VL: an aspect ratio over 200)
            names = ", ".join(describe(reference) for reference in images)
            raise DataError(
                record.source, f"the processor refused the images ({names}): {error}", reason="bad_image"
            ) from error
        replaced = [r for r in (out.get("text_replacement_offsets") or [[]])[0] if r["type"] == "image"]
        if len(replaced) != len(images):
            raise DataError(
                record.source,
                f"the processor placed {len(replaced)} of the {len(images)} images the chat template shows",
                reason="image_not_placed",
            )
        return Expansion(  # as Python ints: some processors (Pixtral's) return tensors by default
            [int(i) for i in out["input_ids"][0]],
            [(int(start), int(end)) for start, end in out["offset_mapping"][0]],
            [tuple(r["span"]) for r in replaced],
            [tuple(r["new_span"]) for r in replaced],
        )

    def _sample(
        self, record: Record, text: str, encoding: Encoding, spans: list[tuple[int, int]], messages: int
    ) -> Sample:
        images = [image for message in record.messages[:messages] for image in message.images]
        shown = text.count(self.image_token)
        if shown != len(images):  # images are matched to placeholders by order: all must be shown
            raise DataError(
                record.source,
                f"the chat template shows {shown} image placeholders ({self.image_token!r}) for the "
                f"{len(images)} images of the turns it renders (it drops or adds images), so they cannot "
                "be matched to their places; set a chat_template that shows every image part",
                reason="template_drops_image",
            )
        expansion = self.expand(record, text, images)
        for (start, end), (image_start, image_end) in ((s, i) for s in spans for i in expansion.spans):
            if start < image_end and image_start < end:
                raise DataError(
                    record.source,
                    "an image is inside an answer; images are context (their tokens are never trained): "
                    "put it in a user turn",
                    reason="image_in_answer",
                )
        moved = [(expansion.moved(start), expansion.moved(end)) for start, end in spans]
        ids = expansion.ids
        labels = [IGNORE_INDEX] * len(ids)
        for k, (s, _) in enumerate(expansion.offsets):
            if any(start <= s < end for start, end in moved):
                labels[k] = ids[k]
        self._check_labels(record, encoding, spans, labels)
        if self.train_on == "all":  # every token but the images'
            labels = list(ids)
            for first, last in expansion.image_tokens():
                labels[first:last] = [IGNORE_INDEX] * (last - first)
        return self._truncated(record, ids, labels, images, expansion)

    def _check_labels(
        self, record: Record, encoding: Encoding, spans: list[tuple[int, int]], labels: list[int]
    ) -> None:
        """The labelled tokens are the text path's: the images changed no answer's tokens."""
        text_path = [
            t
            for t, (s, _) in zip(encoding.ids, encoding.offsets, strict=True)
            if any(start <= s < end for start, end in spans)
        ]
        if [label for label in labels if label != IGNORE_INDEX] != text_path:
            raise DataError(
                record.source,
                "the processor's expansion of the images changes how an answer tokenizes, so its labels "
                "cannot be placed exactly",
                reason="image_changes_answer",
            )

    def _truncated(
        self, record: Record, ids: list[int], labels: list[int], images: list[str], expansion: Expansion
    ) -> Sample:
        """The sample cut to ``max_seq_len``, before the first image that would not fit whole."""
        cut, kept = self.max_seq_len, len(images)
        for k, (first, last) in enumerate(expansion.image_tokens()):
            if last > cut:
                cut, kept = min(cut, first), k
                break
        if cut < 2 and len(ids) > cut:
            raise DataError(
                record.source,
                f"its first image ({describe(images[0])}) does not fit in max_seq_len={self.max_seq_len} "
                f"tokens ({expansion.image_tokens()[0][1]} with the text before it): raise max_seq_len "
                "or make the image smaller",
                reason="image_too_long",
            )
        return Sample(ids[:cut], labels[:cut], record.source, len(ids), tuple(images[:kept]))
