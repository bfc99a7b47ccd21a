"""Which ``*ForCausalLM`` classes of the installed transformers lit-instruct can train exactly.

For each class, the statements of its ``forward`` between the lm_head call and the loss are read
(:func:`lit_instruct.models.output_head.post_head_statements`); a class is recognized when every one is
known, and refused otherwise. ``python benchmarks/head_audit.py [--refused]``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import warnings

import transformers
import transformers.models

from lit_instruct.models.output_head import KNOWN_STATEMENTS, UnsupportedModelError, post_head_statements


def causal_lm_classes() -> dict[str, type]:
    found = {}
    for info in pkgutil.iter_modules(transformers.models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # optional dependencies of some families
            continue
        for name, cls in vars(module).items():
            own = inspect.isclass(cls) and cls.__module__ == module.__name__
            if own and name.endswith("ForCausalLM") and hasattr(cls, "forward"):
                found[name] = cls
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--refused", action="store_true", help="list the refused classes and why")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    recognized, refused = [], {}
    for name, cls in sorted(causal_lm_classes().items()):
        try:
            unknown = [
                s
                for s in post_head_statements(cls)
                if not any(re.fullmatch(pattern, s) for pattern, _ in KNOWN_STATEMENTS)
            ]
        except UnsupportedModelError as error:
            refused[name] = str(error)
            continue
        if unknown:
            refused[name] = f"unknown statement `{unknown[0]}`"
        else:
            recognized.append(name)
    total = len(recognized) + len(refused)
    print(f"transformers {transformers.__version__}: {total} *ForCausalLM classes")
    print(f"recognized: {len(recognized)}, refused: {len(refused)}")
    if args.refused:
        for name, why in refused.items():
            print(f"  {name}: {why}")


if __name__ == "__main__":
    main()
