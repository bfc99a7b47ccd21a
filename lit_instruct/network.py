"""Whether a service answers, found out in seconds (compute nodes often have no internet, and the
clients of the hub and of W&B retry for minutes before they give up)."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0


def reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``url``'s host and port (443 for https, 80 for http) opens within
    ``timeout`` seconds."""
    parsed = urlparse(url)
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False
