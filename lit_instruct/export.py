"""Write PEFT adapters atomically: a temporary folder beside the target, renamed into place."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any


def save_adapter(peft_model: Any, target: str | Path) -> Path:
    """Save ``peft_model``'s adapter (``adapter_model.safetensors`` + ``adapter_config.json``).

    The previous adapter at ``target``, if any, stays intact until the new one is complete.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        peft_model.save_pretrained(staging, safe_serialization=True)
        staging.chmod(0o755)
        if target.exists():
            retired = target.with_name(f".{target.name}-old")
            shutil.rmtree(retired, ignore_errors=True)
            target.rename(retired)
            staging.rename(target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
