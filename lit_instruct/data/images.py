"""Images in records: what a record may name as an image, where it is found, and the check that it
opens before any model is loaded.

A record names an image as a path (relative to the data file's folder, or absolute), a ``file://``
URL, a ``data:image/...;base64,`` URL, a table cell's ``{"bytes": ..., "path": ...}`` or an image a
dataset already decoded (PIL). Each becomes one string, its *reference*: an absolute path, or a data
URL holding the bytes. Web URLs are refused: training never downloads.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from lit_instruct.data.records import DataError

IMAGE_PLACEHOLDER = "<image>"
"""Where a ShareGPT/LLaVA or TRL record puts each of its ``images`` in a turn's text."""
DATA_URL = "data:"


def _decoded(value: str, source: str, field: str) -> bytes:
    header, _, payload = value.partition(",")
    if not header.endswith(";base64") or not payload:
        raise DataError(
            source, f"field '{field}': a data URL must be data:image/...;base64,<bytes>", "bad_image"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise DataError(
            source, f"field '{field}': its base64 does not decode ({error})", "bad_image"
        ) from error


def _as_data_url(data: bytes) -> str:
    return f"{DATA_URL}image;base64,{base64.b64encode(data).decode()}"


def image_reference(value: Any, base: Path | None, source: str, field: str) -> str:
    """The reference of the image a record names at ``field`` (``base``: the data file's folder,
    against which relative paths are read; ``None`` for a hub dataset).

    Raises:
        DataError: (``bad_image``) for a value that names no image, a web URL, a missing file.
    """
    if isinstance(value, dict) and isinstance(value.get("bytes"), bytes | bytearray) and value["bytes"]:
        return _as_data_url(bytes(value["bytes"]))
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        value = value["path"]
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image a dataset decoded
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return _as_data_url(buffer.getvalue())
    if not isinstance(value, str) or not value.strip():
        raise DataError(
            source,
            f"field '{field}' must name an image (a path, a data: URL or bytes), got {type(value).__name__}",
            "bad_image",
        )
    if value.startswith(DATA_URL):
        _decoded(value, source, field)
        return value
    if value.startswith(("http://", "https://")):
        raise DataError(
            source,
            f"field '{field}' is a web URL ({value[:60]}); training never downloads: save the image and "
            "name its path",
            "bad_image",
        )
    path = Path(value.removeprefix("file://")).expanduser()
    if not path.is_absolute():
        if base is None:
            raise DataError(
                source, f"field '{field}': relative image path {value!r} in a hub dataset", "bad_image"
            )
        path = base / path
    if not path.is_file():
        raise DataError(source, f"field '{field}': image file {str(path)!r} does not exist", "bad_image")
    return str(path.resolve())


def image_bytes(reference: str) -> bytes:
    """The bytes of the image at ``reference`` (:func:`image_reference`)."""
    if reference.startswith(DATA_URL):
        return base64.b64decode(reference.partition(",")[2])
    return Path(reference).read_bytes()


def open_image(reference: str) -> Any:
    """The image at ``reference`` as an RGB PIL image, fully decoded."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(image_bytes(reference))) as image:
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")  # a photo as taken (as transformers reads it)


def check_image(reference: str, source: str, field: str) -> None:
    """Refuse an image PIL cannot open and decode whole (a cut file, another format).

    Raises:
        DataError: (``bad_image``) naming ``field`` and the file.
    """
    try:
        open_image(reference)
    except Exception as error:  # PIL raises many kinds: UnidentifiedImageError, OSError, SyntaxError
        shown = "the data URL" if reference.startswith(DATA_URL) else repr(reference)
        raise DataError(
            source, f"field '{field}': {shown} is not an image PIL can read ({error})", "bad_image"
        ) from error


def describe(reference: str) -> str:
    """A short name for an image: its file name, or ``data URL (N bytes)``."""
    if reference.startswith(DATA_URL):
        return f"data URL ({len(image_bytes(reference))} bytes)"
    return Path(reference).name


IMAGE_FIELDS = ("images", "image")
"""Top-level fields holding a record's images (TRL's ``images``, LLaVA's ``image``), taken in order
by the image parts that carry none and by ``<image>`` placeholders."""
TURN_LISTS = {"chat": ("messages", "content"), "sharegpt": ("conversations", "value")}
"""Formats whose turns may show images: the turn list and the field of each turn's content."""


def _part_payload(part: dict[str, Any]) -> Any:
    """What an image part names (``None``: the next of the record's ``images``)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return next((part[key] for key in ("image", "url", "path") if part.get(key) is not None), None)


class _Images:
    """A record's top-level images, handed out in order, and the references made so far."""

    def __init__(self, raw: dict[str, Any], base: Path | None, source: str) -> None:
        self.base, self.source = base, source
        found = [key for key in IMAGE_FIELDS if raw.get(key) not in (None, [], "")]
        if len(found) > 1:
            raise DataError(source, "the record has both 'images' and 'image': keep one", "bad_image")
        self.field = found[0] if found else "images"
        listed = raw.get(self.field) if found else []
        self.listed = listed if isinstance(listed, list) else [listed]
        self.taken = 0

    def take(self, where: str) -> str:
        if self.taken >= len(self.listed):
            raise DataError(
                self.source,
                f"field '{where}' shows an image but the record's '{self.field}' has only {len(self.listed)}",
                "bad_image",
            )
        self.taken += 1
        return self.reference(self.listed[self.taken - 1], f"{self.field}[{self.taken - 1}]")

    def reference(self, value: Any, field: str) -> str:
        reference = image_reference(value, self.base, self.source, field)
        check_image(reference, self.source, field)
        return reference


def _split_text(text: str, images: _Images, where: str) -> list[dict[str, Any]]:
    """``text`` as parts, each ``<image>`` in it one of the record's listed images."""
    parts: list[dict[str, Any]] = []
    for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            parts.append({"type": "image", "reference": images.take(where)})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _turn_parts(content: Any, images: _Images, where: str) -> Any:
    """A turn's content with each image part (and, where the record lists images, each ``<image>``
    in its text) as ``{"type": "image", "reference": ...}``; content without images as it was."""
    if isinstance(content, str):
        if not images.listed or IMAGE_PLACEHOLDER not in content:
            return content
        return _split_text(content, images, where)
    if not isinstance(content, list):
        return content
    out: list[Any] = []
    for k, part in enumerate(content):
        field = f"{where}[{k}]"
        if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
            payload = _part_payload(part)
            reference = images.take(field) if payload is None else images.reference(payload, field)
            out.append({"type": "image", "reference": reference})
        elif isinstance(part, dict) and isinstance(part.get("text"), str) and images.listed:
            out.extend(_split_text(part["text"], images, f"{field}.text"))
        else:
            out.append(part)
    return out


def with_image_references(raw: dict[str, Any], fmt: str, base: Path | None, source: str) -> dict[str, Any]:
    """``raw`` with every image it names as a checked reference inside its turns' content parts
    (its top-level ``images``/``image`` given out to the parts without one and to ``<image>``
    placeholders, in order; with neither, all at the start of the first user turn, as TRL places
    them), and the top-level field removed.

    Raises:
        DataError: (``bad_image``) a missing or unreadable image, a format that cannot show
            images, or images and their places that do not pair up.
    """
    images = _Images(raw, base, source)
    turn_lists = TURN_LISTS.get(fmt)
    if fmt == "prompt_completion":
        turn_lists = None
        lists = [key for key in ("prompt", "completion") if isinstance(raw.get(key), list)]
    else:
        lists = [turn_lists[0]] if turn_lists else []
    if not lists:
        if images.listed:
            raise DataError(
                source,
                f"field '{images.field}': images are read in chat, ShareGPT and conversational "
                f"prompt/completion records (turns as message lists), not in this {fmt} record",
                "bad_image",
            )
        return raw
    content_key = turn_lists[1] if turn_lists else "content"
    out = {key: value for key, value in raw.items() if key not in IMAGE_FIELDS or not images.listed}
    for key in lists:
        turns = raw[key]
        if isinstance(turns, str) and images.listed:  # a table column may keep the turns as JSON text
            from lit_instruct.data.records import _json_value  # its strict reading: depth, repeated keys

            turns = _json_value(turns, key, source)
        if not isinstance(turns, list):
            if images.listed:
                raise DataError(
                    source,
                    f"field '{images.field}' lists images but '{key}' is not a list of turns to show them in",
                    "bad_image",
                )
            return raw  # a bad type: the format's parser says what is wrong
        new_turns = []
        for i, turn in enumerate(turns):
            if isinstance(turn, dict) and content_key in turn:
                turn = {
                    **turn,
                    content_key: _turn_parts(turn[content_key], images, f"{key}[{i}].{content_key}"),
                }
            new_turns.append(turn)
        out[key] = new_turns
    if images.listed and images.taken == 0:
        _place_at_first_user_turn(out, lists, content_key, images)
    elif images.taken < len(images.listed):
        raise DataError(
            source,
            f"field '{images.field}' lists {len(images.listed)} images but the turns show {images.taken} "
            f"({IMAGE_PLACEHOLDER} or an image part each)",
            "bad_image",
        )
    return out


def _place_at_first_user_turn(
    out: dict[str, Any], lists: list[str], content_key: str, images: _Images
) -> None:
    for key in lists:
        for i, turn in enumerate(out[key]):
            if isinstance(turn, dict) and turn.get("role", turn.get("from")) in ("user", "human"):
                text = turn.get(content_key)
                parts = [{"type": "image", "reference": images.take(f"{key}[{i}]")} for _ in images.listed]
                rest = text if isinstance(text, list) else [{"type": "text", "text": text}] if text else []
                out[key][i] = {**turn, content_key: parts + rest}
                return
    raise DataError(
        images.source, f"field '{images.field}': the record has no user turn to show them", "bad_image"
    )
