"""Where records come from: files, folders, ``save_to_disk`` datasets and Hugging Face Hub ids.

JSON arrays and JSON Lines are read here (so that errors name the line); parquet, arrow and csv files,
``save_to_disk`` folders and hub datasets are read through ``datasets`` (memory-mapped, a row at a
time; errors name the file and row). A folder that is not a saved dataset is read file by file, in
name order. A hub id is tried only when no such local path exists; without a network it fails within
seconds (see :func:`load_hub_dataset`).
"""

from __future__ import annotations

import codecs
import difflib
import hashlib
import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_instruct.data.chatterbot import corpus_dir, read_chatterbot
from lit_instruct.data.records import DataError, Record, RecordFormat, to_record
from lit_instruct.data.strict_json import (
    INVALID_UTF8,
    JSONProblem,
    StrictDecoder,
    byte_of,
    is_utf8,
    readable,
    value_end,
)
from lit_instruct.errors import ConfigError
from lit_instruct.network import reachable
from lit_instruct.templates import template_text

UTF8 = "utf-8-sig"
"""How text files are decoded: UTF-8, a byte-order mark at the start (Excel, Notepad) skipped."""

TABLE_SUFFIXES = (".parquet", ".arrow", ".csv")
"""Files read as tables through ``datasets``."""
DATA_SUFFIXES = (".json", ".jsonl", *TABLE_SUFFIXES)
NOT_UTF8 = "the file is not UTF-8 text (re-encode it: iconv -f <its encoding> -t utf-8)"
NOT_DATA = ("dataset_info.json",)
"""Files of a data folder that describe it rather than hold records (LLaMA-Factory's mapping)."""
CHATTERBOT = "chatterbot:"
"""Path prefix of the bundled chatterbot corpus: ``chatterbot:all``, ``chatterbot:greetings,ai``."""


@dataclass
class DataSource:
    """One dataset of a mixture.

    Args:
        path: a JSON/JSONL/parquet/arrow/csv file, a folder of them, a ``save_to_disk`` folder, or a
            Hugging Face Hub dataset id.
        name: the source's name in counts and metrics (``val/loss/<name>``); default: the file stem
            or the id's last part.
        split: the split of a hub dataset or of a ``save_to_disk`` folder holding several.
        format: record format, or ``auto`` to detect it per record.
        columns: our field name -> the dataset's (``{"instruction": "question", "output": "answer"}``,
            ``{"messages": "dialog"}``).
        weight: how many times each sample is drawn per epoch on average (``2``: twice, ``0.5``: a
            different half each epoch), so sources mix in proportion to ``weight x size``.
        val_fraction: share held out for validation (default: the data module's).
        chat_template: this source's template (Jinja, or ``alpaca``), else the data module's.
    """

    path: str
    name: str | None = None
    split: str = "train"
    format: RecordFormat = "auto"
    columns: dict[str, str] = field(default_factory=dict)
    weight: float = 1.0
    val_fraction: float | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ConfigError("data.sources", f"{self.path}: weight must be > 0, got {self.weight}")
        if self.val_fraction is not None and not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(
                "data.sources", f"{self.path}: val_fraction must be in [0, 1), got {self.val_fraction}"
            )
        self.chat_template = template_text(self.chat_template, f"data.sources: {self.path}: chat_template")
        if self.name is None and self.path.startswith(CHATTERBOT):
            self.name = "chatterbot"
        if self.name is None:
            path = Path(self.path)
            self.name = path.stem if path.exists() else self.path.rstrip("/").split("/")[-1]

    @property
    def is_local(self) -> bool:
        """Whether ``path`` is on this machine (else a hub id, or the bundled chatterbot corpus)."""
        return Path(self.path).exists()

    def check_exists(self) -> None:
        """Refuse a path that looks local (a data file's suffix, ``./``, ``/``, ``~``, or a folder
        that exists before its last part) but is not there, naming the closest names beside it.

        Raises:
            DataError: (``missing_source``) naming the path.
        """
        path = Path(self.path).expanduser()
        if self.is_local or self.path.startswith(CHATTERBOT):
            return
        looks_local = path.suffix in DATA_SUFFIXES or self.path.startswith((".", "/", "~"))
        if not looks_local and not (len(path.parts) > 2 and path.parent.is_dir()):
            return  # a hub id (``owner/name``)
        beside = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
        close = difflib.get_close_matches(path.name, beside, n=3, cutoff=0.6)
        hint = f"; closest: {', '.join(str(path.parent / c) for c in close)}" if close else ""
        where = "" if path.parent.is_dir() else f" (nor does its folder {path.parent})"
        raise DataError(str(path), f"no such file or folder{where}{hint}", "missing_source")


@dataclass(frozen=True)
class RawRecord:
    """One record as read: its text, where it is, and its parsed value or why it could not be parsed."""

    text: str
    source: str
    value: Any = None
    error: DataError | None = None


def iter_json(path: Path) -> Iterator[RawRecord]:
    """Each record of a JSON array file, or of a JSON Lines file read line by line (blank lines in
    between are errors, trailing ones end the file; a truncated line is named as such). A record
    that cannot be parsed or used (bytes that are not UTF-8, a repeated key, nesting too deep) is an
    error of its own; an array whose structure is broken is one error for the file."""
    if path.suffix == ".json" and _starts_with_bracket(path):
        yield from _iter_array(path)
        return
    blank: list[int] = []  # blank lines seen since the last record: errors only if one follows
    decoder = StrictDecoder()
    with path.open(encoding=UTF8, errors="surrogateescape") as lines:
        for lineno, line in enumerate(lines, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                blank.append(lineno)
                continue
            for number in blank:
                source = f"{path}:{number}"
                yield RawRecord("", source, error=DataError(source, "blank line", "blank_line"))
            blank = []
            yield parse_line(line, f"{path}:{lineno}", decoder)


def _starts_with_bracket(path: Path) -> bool:
    """Whether the file's first non-blank character is ``[`` (a JSON array, not JSON Lines)."""
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.removeprefix(codecs.BOM_UTF8).strip():
                return chunk.removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[")
    return False


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip_space(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]  # matches anywhere


def _line_and_column(text: str, pos: int) -> tuple[int, int]:
    return text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)


def _array_values(text: str) -> Iterator[tuple[int, int, Any, JSONProblem | None]]:
    """Each value of the JSON array ``text``: where it starts and ends, the value or why it cannot be
    used. A broken structure raises ``JSONDecodeError``."""
    decoder = StrictDecoder()
    pos = _skip_space(text, _skip_space(text, 0) + 1)  # past the opening bracket
    while not text.startswith("]", pos):
        start = pos
        try:
            value, pos = decoder.raw_decode(text, start)
            yield start, pos, value, None
        except JSONProblem as problem:
            end = problem.end if problem.end is not None else value_end(text, start)
            if end is None:
                raise json.JSONDecodeError("Unterminated value", text, start) from problem
            yield start, end, None, problem
            pos = end
        pos = _skip_space(text, pos)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
            if text.startswith("]", pos):
                raise json.JSONDecodeError("Illegal trailing comma before end of array", text, pos)
        elif not text.startswith("]", pos):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
    pos = _skip_space(text, pos + 1)
    if pos != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)


def _iter_array(path: Path) -> Iterator[RawRecord]:
    """The records of a JSON array file, each named ``file[record N]`` (its line in the message)."""
    text = path.read_bytes().decode(UTF8, "surrogateescape")
    try:
        for index, (start, end, value, problem) in enumerate(_array_values(text), start=1):
            source = f"{path}[record {index}]"
            line, column = _line_and_column(text, start)
            bad = INVALID_UTF8.search(text, start, end)
            if bad:
                line, column = _line_and_column(text, bad.start())
                message = f"line {line}, column {column}: invalid UTF-8 ({byte_of(bad)}): {NOT_UTF8}"
                error = DataError(source, message, "invalid_utf8")
            elif problem is not None:
                error = DataError(source, f"line {line}: {problem.message}", problem.reason)
            else:
                yield RawRecord(json.dumps(value), source, value)
                continue
            yield RawRecord(readable(text[start:end]), source, error=error)
    except json.JSONDecodeError as err:  # the whole file is unusable: always an error
        raise DataError(f"{path}:{err.lineno}", f"invalid JSON: {err.msg}", "invalid_json") from err


def parse_line(line: str, source: str, decoder: StrictDecoder | None = None) -> RawRecord:
    """One JSON Lines record, or the reason it is not one."""
    bad = INVALID_UTF8.search(line)
    if bad:
        message = f"invalid UTF-8 at column {bad.start() + 1} ({byte_of(bad)}): {NOT_UTF8}"
        return RawRecord(readable(line), source, error=DataError(source, message, "invalid_utf8"))
    try:
        return RawRecord(line, source, (decoder or StrictDecoder()).loads(line))
    except json.JSONDecodeError as err:
        if err.pos >= len(line.rstrip()) or err.msg.startswith("Unterminated string"):
            error = DataError(source, f"line is truncated: the JSON ends early ({err.msg})", "truncated_line")
        else:
            error = DataError(source, f"invalid JSON at column {err.colno}: {err.msg}", "invalid_json")
    except JSONProblem as problem:
        error = DataError(source, problem.message, problem.reason)
    return RawRecord(line, source, error=error)


def iter_csv_text(path: Path) -> Iterator[RawRecord]:
    """The rows of a csv file that is not all UTF-8 (``datasets`` cannot read it): every cell text, as
    :func:`csv_as_text` reads them; a row holding a byte that is not UTF-8 is an error naming its
    line, rows numbered as ``datasets`` numbers them."""
    import csv

    with path.open(encoding=UTF8, errors="surrogateescape", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, [])
        index, line = 0, reader.line_num + 1  # the line the next row starts on
        for cells in reader:
            start, line = line, reader.line_num + 1
            if not cells:  # a blank line: no row
                continue
            source = f"{path}:row {index}"
            index += 1
            row: dict[str, Any] = dict(zip(header, cells + [None] * (len(header) - len(cells)), strict=False))
            error = _csv_row_error(header, cells, start, source)
            if error is not None:
                yield RawRecord(readable(json.dumps(row, ensure_ascii=False)), source, error=error)
            else:
                yield RawRecord(json.dumps(row), source, row)


def _csv_row_error(header: list[str], cells: list[str], start: int, source: str) -> DataError | None:
    """Why a csv row (starting on line ``start``) cannot be read: a byte that is not UTF-8 in a cell or
    the header, more cells than the header names."""
    for j, cell in enumerate([*header, *cells]):
        bad = INVALID_UTF8.search(cell)
        if bad:
            if j < len(header):
                where, line = f"column name {readable(cell)!r}", 1
            else:
                k = j - len(header)
                where = f"field {readable(header[k]) if k < len(header) else k!r}"
                line = start + sum(c.count("\n") for c in cells[:k]) + cell.count("\n", 0, bad.start())
            return DataError(
                source, f"{where}: invalid UTF-8 at line {line} ({byte_of(bad)}): {NOT_UTF8}", "invalid_utf8"
            )
    if len(cells) > len(header):
        return DataError(source, f"the row has {len(cells)} cells, the header {len(header)}", "bad_type")
    return None


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` was written by ``Dataset(Dict).save_to_disk``."""
    return any((folder / name).exists() for name in ("state.json", "dataset_dict.json"))


def load_table(path: Path, split: str = "train") -> Any:
    """A parquet / arrow / csv file or a ``save_to_disk`` folder as a ``datasets.Dataset``."""
    import datasets

    if path.is_dir():
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                splits = ", ".join(dataset)
                raise DataError(
                    str(path), f"has no split {split!r} (it has: {splits}); set split", "bad_type"
                )
            dataset = dataset[split]
        return dataset
    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path))
    if path.suffix == ".csv":  # cells are text: `6` is an answer, not a number to refuse
        return datasets.Dataset.from_csv(str(path), **csv_as_text(path))
    return datasets.Dataset.from_file(str(path))


def csv_as_text(path: Path) -> dict[str, Any]:
    """``datasets``' CSV options that read every cell as the text it is (pandas would make a number
    of the answer ``6`` and NaN of ``NA``)."""
    import csv

    import datasets

    with path.open(encoding=UTF8, newline="") as handle:
        header = next(csv.reader(handle), [])
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": features, "keep_default_na": False, "encoding": UTF8}


def iter_rows(dataset: Any, where: str) -> Iterator[RawRecord]:
    """Each row of a ``datasets.Dataset`` as a record located ``<where>:row N``."""
    for index, row in enumerate(dataset):
        yield RawRecord(json.dumps(row, default=str), f"{where}:row {index}", row)


def load_hub_dataset(repo_id: str, split: str, streaming: bool = False) -> Any:
    """A hub dataset's split, from the network or the local ``datasets`` cache.

    With ``HF_HUB_OFFLINE=1``, or when the hub's endpoint does not answer within a few seconds, the
    load runs in offline mode (the cache only) instead of spending minutes in retries; a dataset
    that is not cached is then a :class:`DataError` that says so.
    """
    import datasets
    import datasets.config
    import huggingface_hub.constants as hub

    offline = bool(hub.HF_HUB_OFFLINE) or not reachable(hub.ENDPOINT)
    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = offline or saved[0]
    try:
        return datasets.load_dataset(repo_id, split=split, streaming=streaming)
    except (ConnectionError, FileNotFoundError, OSError) as error:
        if not offline:
            raise DataError(repo_id, f"could not load the hub dataset: {error}", "missing_source") from error
        why = "HF_HUB_OFFLINE is set" if saved[0] else f"the Hugging Face Hub ({hub.ENDPOINT}) is unreachable"
        raise DataError(
            repo_id,
            f"is neither a local path nor a cached hub dataset, and {why}: download it once where there "
            f"is a network (it is then kept in {datasets.config.HF_DATASETS_CACHE}), or point path at local "
            "files",
            "missing_source",
        ) from error
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def data_files(path: Path) -> list[Path]:
    """The files a local source reads: itself, or a plain folder's data files in name order."""
    if not path.is_dir() or is_saved_dataset(path):
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
    described = [p for p in files if p.name in NOT_DATA]
    if described:
        warnings.warn(
            f"{path}: not reading {', '.join(str(p) for p in described)}: it describes datasets "
            "(LLaMA-Factory's mapping) and holds no records; set each source's format and columns instead",
            stacklevel=2,
        )
        files = [p for p in files if p.name not in NOT_DATA]
    if not files:
        raise DataError(str(path), f"holds no data file ({', '.join(DATA_SUFFIXES)})", "missing_source")
    return files


def iter_source(source: DataSource, streaming: bool = False) -> Iterator[RawRecord]:
    """Every raw record of ``source``, in order.

    With ``streaming``, parquet and csv files and hub datasets are iterated without being converted
    to an Arrow copy first (``datasets``' streaming mode); JSON Lines files are always read line by
    line and arrow files and saved folders are memory-mapped.
    """
    path = Path(source.path)
    if not source.is_local:
        source.check_exists()
        dataset = load_hub_dataset(source.path, source.split, streaming)
        yield from iter_rows(dataset, f"{source.path}[{source.split}]")
        return
    for file in data_files(path):
        if file.suffix == ".csv" and not is_utf8(file):  # datasets would fail on the whole file
            yield from iter_csv_text(file)
        elif streaming and file.suffix in (".parquet", ".csv"):
            import datasets

            builder = file.suffix[1:]
            text = csv_as_text(file) if builder == "csv" else {}
            dataset = datasets.load_dataset(
                builder, data_files=str(file), split="train", streaming=True, **text
            )
            yield from iter_rows(dataset, str(file))
        elif file.is_dir() or file.suffix in TABLE_SUFFIXES:
            yield from iter_rows(load_table(file, source.split), str(file))
        else:
            yield from iter_json(file)


def chatterbot_categories(source: DataSource) -> list[str] | None:
    """The categories of a ``chatterbot:<a,b|all>`` source (``None``: all), else raises ``ValueError``."""
    if not source.path.startswith(CHATTERBOT):
        raise ValueError(f"{source.path} is not a chatterbot source")
    names = source.path[len(CHATTERBOT) :].split(",")
    return None if names in (["all"], [""]) else names


def parse(raw: RawRecord, source: DataSource) -> Record:
    """The record ``raw`` holds, read with ``source``'s format and column mapping.

    Raises:
        DataError: why it could not be read, or what is wrong with it.
    """
    if raw.error is not None:
        raise raw.error
    return to_record(raw.value, raw.source, source.format, source.columns, image_folder(source))


def image_folder(source: DataSource) -> Path | None:
    """Where ``source``'s relative image paths are read from: its folder, or its file's (``None``
    for a hub dataset)."""
    if not source.is_local:
        return None
    path = Path(source.path).expanduser().resolve()
    return path if path.is_dir() else path.parent


def count_unused(record: Record, counts: Counter[str] | None) -> None:
    """Count the fields ``record`` carried but no format uses (reported at setup, never silent)."""
    if counts is not None:
        for name in record.unused:
            counts[f"unused_field_{name}"] += 1


def read_source(
    source: DataSource | str | Path,
    on_bad: Callable[[RawRecord, DataError], None] | None = None,
    counts: Counter[str] | None = None,
) -> list[Record]:
    """Every record of a source (a :class:`DataSource` or a path).

    Args:
        source: what to read.
        on_bad: called with each bad record and its error, which is then skipped; without it the
            first bad record raises its :class:`DataError`.
        counts: receives what the chatterbot reader leaves off.
    """
    if not isinstance(source, DataSource):
        source = DataSource(str(source))
    if source.path.startswith(CHATTERBOT):
        return read_chatterbot(chatterbot_categories(source), counts=counts)
    records = []
    for raw in iter_source(source):
        try:
            record = parse(raw, source)
            records.append(record)
            count_unused(record, counts)
        except DataError as error:
            if on_bad is None:
                raise
            on_bad(raw, error)
    return records


def fingerprint(source: DataSource) -> str:
    """A digest of what ``source`` reads: its files' contents, or a hub dataset's fingerprint."""
    digest = hashlib.sha256()
    if source.path.startswith(CHATTERBOT):
        categories = chatterbot_categories(source)
        files = sorted(corpus_dir().glob("*.yml"))
        for file in files if categories is None else [f for f in files if f.stem in categories]:
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
        return digest.hexdigest()
    if not source.is_local:
        source.check_exists()
        digest.update(load_hub_dataset(source.path, source.split)._fingerprint.encode())
        return digest.hexdigest()
    for file in data_files(Path(source.path)):
        parts = sorted(p for p in file.rglob("*") if p.is_file()) if file.is_dir() else [file]
        for part in parts:
            digest.update(os.fsencode(part.relative_to(file) if file.is_dir() else part.name) + b"\0")
            with part.open("rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
    return digest.hexdigest()
