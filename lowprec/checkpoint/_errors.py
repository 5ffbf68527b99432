"""The one exception type of lowprec.checkpoint."""


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed, unsafe to load, or would be overwritten."""
