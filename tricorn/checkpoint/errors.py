"""The checkpoint error: one line naming the file, raised alike on every rank (io.py's checks, DCP's reads)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the file."""
