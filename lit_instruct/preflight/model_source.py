"""Where ``model.model`` points, found out before anything is loaded: a bundled name, a local
``transformers`` folder, or a hub id that is cached or reachable; anything else is a config error."""

from __future__ import annotations

import re
from pathlib import Path

from lit_instruct.errors import ConfigError
from lit_instruct.model_names import BUNDLED_MODELS, bundled_name, resolve_model_path
from lit_instruct.network import reachable

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""``owner/name`` (or a bare ``name``) as the Hugging Face Hub spells repository ids."""


def _no_model(name: str, why: str, setting: str) -> ConfigError:
    bundled = ", ".join(sorted(BUNDLED_MODELS))
    return ConfigError(
        setting,
        f"{name!r} {why}; give a transformers model folder (with config.json), a bundled name ({bundled}) "
        "or a hub id (owner/name)",
    )


def model_source(name: str, setting: str = "model.model") -> str:
    """The local folder or hub id ``name`` loads from (a bundled model is prepared on first use).

    Raises:
        ConfigError: a folder that is missing or holds no ``config.json``, or a hub id that is not
            cached while the hub is unreachable (or ``HF_HUB_OFFLINE`` is set).
    """
    if bundled_name(name) is not None:  # its short name, or the hub id its adapters record
        return resolve_model_path(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise _no_model(name, "is a folder without config.json (not a transformers model)", setting)
        return str(path)
    if path.exists():
        raise _no_model(name, "is a file, not a model folder", setting)
    if not HUB_ID.fullmatch(name) or name.startswith((".", "~")):
        raise _no_model(name, "is no folder here", setting)
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name
    if constants.HF_HUB_OFFLINE:
        raise _no_model(name, "is no folder here and no cached hub model, and HF_HUB_OFFLINE is set", setting)
    if not reachable(constants.ENDPOINT):
        raise _no_model(
            name,
            f"is no folder here and no cached hub model, and the hub ({constants.ENDPOINT}) is unreachable",
            setting,
        )
    return name
