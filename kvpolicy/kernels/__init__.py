"""Kernel ops with a PyTorch reference and swappable fast backends (see ``dispatch``)."""

from . import dispatch, reference

__all__ = ["dispatch", "reference"]
