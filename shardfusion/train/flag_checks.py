"""Helpers the config sections share for their flag checks (`ft_config`, `outer_config`)."""

from __future__ import annotations

from typing import Iterable


def refuse_first(candidates: Iterable[tuple[str, object, bool]], mode: str, why: str) -> None:
    """Raise ValueError ``"<flag> <value> with <mode>: <why>"`` for the first ``(flag, value, refused)`` whose
    ``refused`` is true; nothing when none is."""
    for flag, value, refused in candidates:
        if refused:
            raise ValueError(f"{flag} {value} with {mode}: {why}")
