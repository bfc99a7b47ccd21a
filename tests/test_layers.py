"""Imports point one way: lower floors never pull in higher ones.

From the bottom: the ground floor (the top-level modules: ``labels``, ``io``, ``model_names``,
``templates``, ``adapter_folder``, ``vocabulary``...), then ``loss`` and ``data`` (each on the ground
only), ``models``, then ``preflight``, ``train`` and ``export`` on the models, ``infer`` on those, and
the CLI and the callbacks at the top. Every ``import`` statement counts, also those inside functions;
third-party libraries a floor must not load are checked in fresh interpreters.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lit_instruct"
TOP = {"lit_instruct.cli", "lit_instruct.__main__", "lit_instruct"}
MAY_IMPORT = {
    "lit_instruct.loss": set(),
    "lit_instruct.data": set(),
    "lit_instruct.models": {"lit_instruct.loss"},
    "lit_instruct.rewards": set(),
    "lit_instruct.objectives": {"lit_instruct.loss", "lit_instruct.rewards"},
    "lit_instruct.preflight": {"lit_instruct.loss", "lit_instruct.models", "lit_instruct.objectives"},
    "lit_instruct.train": {"lit_instruct.loss", "lit_instruct.models", "lit_instruct.objectives"},
    "lit_instruct.export": {"lit_instruct.models"},
    "lit_instruct.infer": {
        "lit_instruct.loss",
        "lit_instruct.models",
        "lit_instruct.data",
        "lit_instruct.objectives",
        "lit_instruct.train",
    },
}
"""Each package's floors besides the ground floor (the callbacks and the CLI may import any)."""


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (``callbacks/`` is ``lit_instruct.callbacks``)."""
    found = {}
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "callbacks":
            parts.insert(0, "lit_instruct")
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def imports_of(path: Path) -> set[str]:
    """The ``lit_instruct`` modules ``path`` imports anywhere in it (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.split(".")[0] == "lit_instruct"}


def floor(module: str) -> str:
    """``lit_instruct.train.module`` -> ``lit_instruct.train``; a top-level module is its own floor."""
    return ".".join(module.split(".")[:2])


def is_ground(module: str, packages: set[str]) -> bool:
    return floor(module) not in packages and floor(module) not in TOP


def upward_imports(modules: dict[str, set[str]], packages: set[str]) -> list[str]:
    """Each import of ``modules`` (name -> what it imports) that points above its floor; ``packages``
    are the floors above the ground (the others are ground-floor modules)."""
    wrong = []
    for name, imported in sorted(modules.items()):
        home = floor(name)
        if home in TOP or home == "lit_instruct.callbacks":
            continue
        allowed = MAY_IMPORT.get(home, set()) if home in packages else set()
        for target in sorted(imported):
            there = floor(target)
            if there != home and not is_ground(target, packages) and there not in allowed:
                wrong.append(f"{name} imports {target}")
    return wrong


def test_no_module_imports_above_its_floor() -> None:
    files = module_files()
    packages = {name for name, path in files.items() if path.name == "__init__.py" and name.count(".") == 1}
    assert {"lit_instruct.loss", "lit_instruct.models", "lit_instruct.infer"} <= packages
    assert upward_imports({name: imports_of(path) for name, path in files.items()}, packages) == []


def test_the_floor_check_finds_an_upward_import() -> None:
    """The checker itself: the ground importing ``models``, ``export`` importing ``data`` and ``infer``
    importing ``export`` are each found (the arrows this layout once had)."""
    modules = {
        "lit_instruct.vocabulary": {"lit_instruct.models"},
        "lit_instruct.models.load": {"lit_instruct.io"},
        "lit_instruct.export.gguf": {"lit_instruct.data.templates"},
        "lit_instruct.data.render": set(),
        "lit_instruct.infer.evaluate": {"lit_instruct.export.adapter", "lit_instruct.train.module"},
        "lit_instruct.train.module": set(),
        "lit_instruct.io": set(),
    }
    packages = {"lit_instruct.models", "lit_instruct.export", "lit_instruct.data", "lit_instruct.infer"}
    assert upward_imports(modules, packages | {"lit_instruct.train"}) == [
        "lit_instruct.export.gguf imports lit_instruct.data.templates",
        "lit_instruct.infer.evaluate imports lit_instruct.export.adapter",
        "lit_instruct.vocabulary imports lit_instruct.models",
    ]


@pytest.mark.parametrize(
    ("module", "third_party"),
    [
        ("lit_instruct.loss", {"lightning", "transformers"}),
        ("lit_instruct.io", {"transformers"}),
        ("lit_instruct.distributed", {"lightning"}),
        ("lit_instruct.rules", {"torch"}),
    ],
)
def test_a_floor_loads_no_library_above_it(module: str, third_party: set[str]) -> None:
    code = f"import sys, {module}; print(sorted(m for m in {sorted(third_party)} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} pulls in {out.stdout.strip()}"


def contributing_layout() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """docs/contributing.md's layout: the files it names per folder (``lit_instruct``,
    ``lit_instruct/loss``..., ``callbacks``), and its table of what each package may import."""
    text = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    named: dict[str, set[str]] = {}
    folder = ""
    for line in block.splitlines():
        head = re.match(r"^( {0,2})([\w]+)/ ", line)
        if head:
            folder = f"lit_instruct/{head.group(2)}" if head.group(1) else head.group(2)
        named.setdefault(folder, set()).update(re.findall(r"\b(\w+)\.py\b", line))
    table = text.split("| package | imports, besides the ground floor |", 1)[1].split("\n\n", 1)[0]
    allowed: dict[str, set[str]] = {}
    for row in table.strip().splitlines()[1:]:
        packages, imports = (cell.strip() for cell in row.strip("|").split("|"))
        for package in re.findall(r"`(\w+)`", packages):
            allowed[f"lit_instruct.{package}"] = {
                f"lit_instruct.{name}" for name in re.findall(r"`(\w+)`", imports)
            }
    return named, allowed


def test_the_contributing_layout_is_the_package() -> None:
    """Every module is named in its folder's entry and every named module exists; the import table
    is :data:`MAY_IMPORT` (cli and callbacks: any)."""
    named, allowed = contributing_layout()
    for folder in [
        "lit_instruct",
        *(f"lit_instruct/{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()),
        "callbacks",
    ]:
        files = {path.stem for path in (ROOT / folder).glob("*.py")} - {"__init__"}
        if folder == "lit_instruct":
            files |= {"__init__"}  # the top-level entry names its __init__ and __main__
        listed = named.get(folder, set()) - ({"__init__"} if folder != "lit_instruct" else set())
        assert listed == files, (folder, sorted(files - listed), sorted(listed - files))
    allowed.pop("lit_instruct.cli", None)
    allowed.pop("lit_instruct.callbacks", None)
    assert allowed == MAY_IMPORT
