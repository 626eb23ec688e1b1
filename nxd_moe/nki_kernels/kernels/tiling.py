"""Splitting a dimension into hardware tiles, and a dimension between the cores of a launch."""

from __future__ import annotations


def tiles(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into ``[a, b)`` pieces of at most ``size`` (the last one may be shorter)."""
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


def split(length: int, parts: int, part: int) -> tuple[int, int]:
    """Part ``part`` of ``[0, length)`` cut into ``parts`` contiguous pieces as equal as possible (first ones
    larger)."""
    base, extra = divmod(length, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)
