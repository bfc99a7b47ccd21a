"""Durations as people read them in progress lines."""


def duration(seconds: float) -> str:
    """``1h02m03s``, ``2m03s`` or ``3s``."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
