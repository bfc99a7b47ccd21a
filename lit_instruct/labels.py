"""Label conventions shared by the data pipeline and the losses (imports nothing)."""

IGNORE_INDEX = -100
"""Label of a position that is not predicted: prompt, template markup, padding."""
