"""The one exception type of the data pipeline (kept free of torch so preprocessing workers start fast)."""

from __future__ import annotations


class DataError(ValueError):
    """A data file, tokenizer or data flag is unusable; the message is one line naming the file and the fix."""
