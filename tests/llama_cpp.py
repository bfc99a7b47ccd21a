"""llama.cpp's own converters, the independent reference for GGUF files: ``convert_hf_to_gguf.py`` and
``convert_lora_to_gguf.py`` ship, pure Python, in the ``llama-cpp-python`` source distribution on PyPI.

The sdist is downloaded once (``pip download``, no build) and its converter folder extracted into the
lit-instruct cache; tests skip with the reason where the registry cannot be reached, and fail in CI
(``CI=true``), whose ``.ci/run`` fetches it first (``python -m tests.llama_cpp``).
"""

from __future__ import annotations

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


RUN_WITH_PRE = """
import runpy, sys
sys.path.insert(0, {folder!r})
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(model_dir: Path, out: Path, outtype: str = "f16", tokenizer_pre: str | None = None) -> Path:
    """``convert_hf_to_gguf.py model_dir --outtype outtype --outfile out`` (its own gguf-py).

    ``tokenizer_pre`` names the pre-tokenizer instead of the converter's hash of the tokenizer's output
    (a tiny model of another family with SmolLM2's vocabulary: ``transformers`` then loads the family's
    own tokenizer class, whose pre-tokenization the converter does not recognise)."""
    script = converter_dir() / "convert_hf_to_gguf.py"
    argv = [str(script), str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    command = [sys.executable, *argv]
    if tokenizer_pre is not None:
        code = RUN_WITH_PRE.format(folder=str(script.parent), pre=tokenizer_pre, argv=argv)
        command = [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def convert_lora(adapter_dir: Path, base_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """``convert_lora_to_gguf.py adapter_dir --base base_dir --outtype outtype --outfile out``."""
    script = converter_dir() / "convert_lora_to_gguf.py"
    command = [sys.executable, str(script), str(adapter_dir), "--base", str(base_dir)]
    command += ["--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def contents(path: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], str, np.ndarray]]]:
    """A GGUF file's metadata (key -> value) and tensors (name -> shape, type name, raw data)."""
    import gguf

    reader = gguf.GGUFReader(path)
    metadata = {
        name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")
    }
    tensors = {
        t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name, np.array(t.data)) for t in reader.tensors
    }
    return metadata, tensors


def differences(ours: Path, theirs: Path, allowed: set[str] = frozenset({"general.name"})) -> list[str]:
    """Every metadata key, tensor name, shape, type and byte where the two files differ (``allowed``
    keys apart)."""
    (our_meta, our_tensors), (their_meta, their_tensors) = contents(ours), contents(theirs)
    found = []
    for key in sorted((set(our_meta) | set(their_meta)) - allowed):
        a, b = our_meta.get(key, "<missing>"), their_meta.get(key, "<missing>")
        if a != b:
            found.append(f"metadata {key}: ours {str(a)[:120]} vs llama.cpp {str(b)[:120]}")
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
