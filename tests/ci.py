"""Tests that compare with an outside reference (llama.cpp's converters, a real browser) skip where
the reference is missing, except in CI (``CI=true``), where it must be there: a skip would let the
run pass without the comparison ever made."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """Whether this is a CI run (``CI=true``, as CI services and ``.ci/run``'s caller set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def require_or_skip(reason: str) -> NoReturn:
    """Skip the test for want of a reference (``reason``); in CI, fail it instead."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: the reference must be there, .ci/run installs it)", pytrace=False)
    pytest.skip(reason)
