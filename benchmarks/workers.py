"""Each benchmark measurement runs in a fresh process: ``<script> --worker ARGS...`` prints JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]


def run_worker(script: str, *args: str) -> Any:
    """Run ``script --worker args...`` from the repository root; return the JSON on its last stdout
    line, or exit with the end of its stderr when it fails."""
    out = subprocess.run(
        [sys.executable, script, "--worker", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if out.returncode:
        sys.exit(f"{Path(script).name} --worker {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
