"""The packages, found rather than listed: every package under ``lit_instruct/``, and the top-level
``callbacks/`` installed as ``lit_instruct.callbacks`` (a list kept by hand drifts: the wheel once
lacked ``lit_instruct.preflight``). Everything else is in ``pyproject.toml``."""

from setuptools import find_packages, setup

CALLBACKS = "lit_instruct.callbacks"

packages = find_packages(include=["lit_instruct", "lit_instruct.*"])
packages += [CALLBACKS] + [f"{CALLBACKS}.{name}" for name in find_packages("callbacks")]

setup(packages=packages, package_dir={CALLBACKS: "callbacks"})
