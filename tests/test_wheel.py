"""The built wheel holds every module of the checkout (``pip install`` users get the wheel, not the
folder an editable install finds): issue 49 item 6, the wheel without ``lit_instruct.preflight``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_modules() -> set[str]:
    """Every ``.py`` file of ``lit_instruct/`` and ``callbacks/`` as the wheel must name it."""
    modules = {str(path.relative_to(ROOT)) for path in (ROOT / "lit_instruct").rglob("*.py")}
    modules |= {
        "lit_instruct/callbacks/" + str(path.relative_to(ROOT / "callbacks"))
        for path in (ROOT / "callbacks").rglob("*.py")
    }
    return {module for module in modules if "__pycache__" not in module}


def clean_copy(target: Path) -> Path:
    """The files git would commit (tracked, or new and not ignored), without what an earlier build or
    editable install left in the checkout (``build/``, ``*.egg-info``: setuptools reuses both)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def test_item6_the_wheel_holds_every_module_of_the_checkout(tmp_path: Path) -> None:
    clean = clean_copy(tmp_path / "checkout")
    subprocess.run(  # the sdist, then the wheel from it, as pip builds a package from an index
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(clean)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("lit_instruct-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {name for name in names if name.endswith(".py")}
    assert checkout_modules() - in_wheel == set(), "modules the wheel lacks"
    assert in_wheel - checkout_modules() == set(), "modules the wheel has that the checkout does not"
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "lit-instruct = lit_instruct.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
