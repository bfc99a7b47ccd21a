"""In CI a test that lacks its outside reference fails instead of skipping (:mod:`tests.ci`)."""

from __future__ import annotations

import pytest

from tests.ci import require_or_skip


def test_a_missing_reference_skips_but_fails_in_ci(monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no browser"):
        require_or_skip("no browser")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"no browser \(CI=true"):
        require_or_skip("no browser")
