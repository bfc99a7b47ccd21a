"""llama.cpp's own converters, the independent reference for GGUF files: ``convert_hf_to_gguf.py`` and
``convert_lora_to_gguf.py`` ship, pure Python, in the ``llama-cpp-python`` source distribution on PyPI.

The sdist is downloaded once (``pip download``, no build) and its converter folder extracted into the
lit-instruct cache; tests skip with the reason where the registry cannot be reached, and fail in CI
(``CI=true``), whose ``.ci/run`` fetches it first (``python -m tests.llama_cpp``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from lit_instruct.io import atomic_directory
from lit_instruct.model_names import cache_dir
from tests.ci import require_or_skip

VERSION = "0.3.36"
MEMBERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/")


def converter_dir() -> Path:
    """The folder holding llama.cpp's converters (and their own ``gguf-py``), fetched once."""
    folder = cache_dir() / f"llama.cpp-{VERSION}"
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    with tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        command += [f"llama-cpp-python=={VERSION}", "-d", download, "--disable-pip-version-check"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            error = done.stderr.strip()[-300:]
            require_or_skip(f"llama-cpp-python {VERSION} sdist not downloadable: {error}")
        (sdist,) = Path(download).glob("*.tar.gz")
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar, atomic_directory(folder) as staging:
            for member in tar.getmembers():
                inner = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and inner.startswith(MEMBERS) and member.isfile():
                    member.name = inner
                    tar.extract(member, staging, filter="data")
    return folder


RUN_MANY = """
import json, runpy, sys, traceback
sys.path.insert(0, {folder!r})
from conversion.base import TextModel
own_pre = TextModel.get_vocab_base_pre
failed = {{}}
for argv, pre in json.loads({jobs!r}):
    TextModel.get_vocab_base_pre = own_pre if pre is None else (lambda self, tokenizer, pre=pre: pre)
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            failed[argv[-1]] = "exit status " + str(stop.code)
    except Exception:
        failed[argv[-1]] = traceback.format_exc()[-3000:]
print(json.dumps(failed))
"""


def convert_many(jobs: list[tuple[Path, Path, str, str | None]]) -> dict[Path, str]:
    """:func:`convert` for each ``(model_dir, out, outtype, tokenizer_pre)`` in one process (the
    converter's imports paid once); the traceback of each conversion that failed, by ``out``."""
    script = converter_dir() / "convert_hf_to_gguf.py"
    argv = [([str(script), str(d), "--outtype", t, "--outfile", str(out)], pre) for d, out, t, pre in jobs]
    code = RUN_MANY.format(folder=str(script.parent), jobs=json.dumps(argv))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    return {Path(out): error for out, error in failed.items()}


def convert(model_dir: Path, out: Path, outtype: str = "f16", tokenizer_pre: str | None = None) -> Path:
    """``convert_hf_to_gguf.py model_dir --outtype outtype --outfile out`` (its own gguf-py).

    ``tokenizer_pre`` names the pre-tokenizer instead of the converter's hash of the tokenizer's output
    (a tiny model of another family with SmolLM2's vocabulary: ``transformers`` then loads the family's
    own tokenizer class, whose pre-tokenization the converter does not recognise)."""
    failed = convert_many([(model_dir, out, outtype, tokenizer_pre)])
    assert not failed, failed.get(out)
    return out


def convert_lora(adapter_dir: Path, base_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """``convert_lora_to_gguf.py adapter_dir --base base_dir --outtype outtype --outfile out``."""
    script = converter_dir() / "convert_lora_to_gguf.py"
    command = [sys.executable, str(script), str(adapter_dir), "--base", str(base_dir)]
    command += ["--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


SCALARS = {
    **{0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"},
    **{10: "<u8", 11: "<i8", 12: "<f8"},
}
"""GGUF's value types (``gguf.GGUFValueType``) of fixed size, as numpy dtypes; 8 is a string, 9 an array."""


class _Cursor:
    """Reads GGUF's little-endian values off a byte buffer, in order."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, dtype: str, count: int = 1) -> np.ndarray:
        values = np.frombuffer(self.data, dtype=np.dtype(dtype), count=count, offset=self.at)
        self.at += values.nbytes
        return values

    def number(self, dtype: str = "<u8") -> int:
        return int(self.take(dtype)[0])

    def string(self) -> str:
        length = self.number()
        self.at += length
        return self.data[self.at - length : self.at].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.number("<u4"), self.number()
            if item == 8:
                return [self.string() for _ in range(count)]
            if item == 9:
                return [self.value(9) for _ in range(count)]
            return self.take(SCALARS[item], count).tolist()
        return self.take(SCALARS[kind])[0].item()


Tensors = dict[str, tuple[tuple[int, ...], str, np.ndarray]]


def contents(path: Path) -> tuple[dict[str, Any], Tensors]:
    """A GGUF file's metadata (key -> value) and tensors (name -> shape as stored, type name, data in
    numpy's order: typed for float types, raw bytes per row for quantized ones), as ``gguf.GGUFReader``
    reads them (checked against it by ``tests/test_gguf_reference.py``) without its per-token objects."""
    metadata, _, tensors = _parse(path)
    return metadata, tensors


def _parse(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]], Tensors]:
    """:func:`contents`, with each key's value type (and an array's item type); a repeated key or
    tensor name (which llama.cpp refuses) fails."""
    import gguf

    cursor = _Cursor(Path(path).read_bytes())
    cursor.at = 4
    assert cursor.data[:4] == b"GGUF" and cursor.number("<u4") in (2, 3), f"{path}: not a GGUF file"
    tensor_count, key_count = cursor.number(), cursor.number()
    metadata, kinds = {}, {}
    for _ in range(key_count):
        key = cursor.string()
        assert key not in metadata, f"{path}: key {key} twice"
        kind = cursor.number("<u4")
        item = int(np.frombuffer(cursor.data, "<u4", 1, cursor.at)[0]) if kind == 9 else None
        metadata[key], kinds[key] = cursor.value(kind), (kind, item)
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(int(d) for d in cursor.take("<u8", cursor.number("<u4")))
        infos.append((name, dims, gguf.GGMLQuantizationType(cursor.number("<u4")), cursor.number()))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cursor.at // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        rows = tuple(reversed(dims[1:]))
        count = int(np.prod(dims)) // block * size
        raw = np.frombuffer(cursor.data, dtype=np.uint8, count=count, offset=start + offset)
        typed = {"F32": np.float32, "F16": np.float16, "F64": np.float64}.get(kind.name)
        row = (dims[0],) if typed else (dims[0] // block * size,)
        data = (raw.view(typed) if typed else raw).reshape(*rows, *row)
        assert name not in tensors, f"{path}: tensor {name} twice"
        tensors[name] = (dims, kind.name, data)
    return metadata, kinds, tensors


def differences(ours: Path, theirs: Path, allowed: set[str] = frozenset({"general.name"})) -> list[str]:
    """Every metadata key, value type, tensor name, shape, type and byte where the two files differ
    (``allowed`` keys apart)."""
    our_meta, our_kinds, our_tensors = _parse(ours)
    their_meta, their_kinds, their_tensors = _parse(theirs)
    found = []
    for key in sorted((set(our_meta) | set(their_meta)) - allowed):
        a, b = our_meta.get(key, "<missing>"), their_meta.get(key, "<missing>")
        if a != b:
            found.append(f"metadata {key}: ours {str(a)[:120]} vs llama.cpp {str(b)[:120]}")
        elif our_kinds[key] != their_kinds[key]:  # 1 == 1.0 == True: the value types must agree too
            found.append(f"metadata {key}: ours of type {our_kinds[key]} vs llama.cpp {their_kinds[key]}")
    for name in sorted(set(our_tensors) | set(their_tensors)):
        if name not in our_tensors or name not in their_tensors:
            found.append(f"tensor {name}: only in {'ours' if name in our_tensors else 'llama.cpp'}")
            continue
        (shape, kind, data), (their_shape, their_kind, their_data) = our_tensors[name], their_tensors[name]
        if (shape, kind) != (their_shape, their_kind):
            found.append(f"tensor {name}: ours {shape} {kind} vs llama.cpp {their_shape} {their_kind}")
        elif not np.array_equal(data.view(np.uint8), their_data.view(np.uint8)):
            found.append(f"tensor {name}: data differ")
    return found


if __name__ == "__main__":  # fetch the converters into the cache (CI, before the tests)
    print(f"llama.cpp converters in {converter_dir()}")
