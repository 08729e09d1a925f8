"""Exceptions raised by cswap."""

__all__ = ["CorruptDataError"]


class CorruptDataError(ValueError):
    """A compressed buffer is truncated, overlong, or inconsistent with its header.

    Raised before any kernel reads the payload, or by the decoder's own checks
    when the payload contradicts the header. Nothing is read or written out of
    bounds first.
    """
