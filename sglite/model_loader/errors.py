from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one line naming the problem."""
