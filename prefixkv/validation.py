"""The one check every configuration and request field goes through: a ``ValueError`` whose
message starts with the field's name (the server turns it into a 400 naming that field)."""

from __future__ import annotations


def require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")
