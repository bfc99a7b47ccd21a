"""Keep secrets (API keys, tokens) out of every file a run writes."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

SECRET_NAME = re.compile(r"api_?key|secret|password|passwd|credential|(^|[_-])(auth_?)?token$", re.IGNORECASE)
"""``WANDB_API_KEY``, ``HF_TOKEN``, ``token``, ``auth_token``; not ``new_tokens`` or ``tokenizer``."""
REDACTED = "<redacted>"


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names look secret (``WANDB_API_KEY``, ``HF_TOKEN``...)."""
    variables = os.environ if environ is None else environ
    return [v for k, v in variables.items() if SECRET_NAME.search(k) and len(v) >= 8]


def redact(value: Any, secrets: list[str] | None = None, key: str = "") -> Any:
    """A copy of ``value`` (nested dicts and lists) with secret-looking fields and any occurrence of
    a secret environment value replaced by ``<redacted>``."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, dict):
        return {k: redact(v, secrets, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, secrets, key) for v in value)
    if isinstance(value, str):
        if value and SECRET_NAME.search(key):
            return REDACTED
        for secret in secrets:
            value = value.replace(secret, REDACTED)
    return value
