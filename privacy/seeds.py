"""Where a run's secret randomness comes from.

Both the DP noise and the Poisson batch sampling must be unpredictable to an
adversary: the guarantee assumes nobody knows which examples were sampled or
which noise was drawn. The seed therefore defaults to fresh OS entropy; a fixed
seed is an explicit, logged choice (for debugging and tests).
"""

from __future__ import annotations

import logging
import secrets

_log = logging.getLogger(__name__)


def resolve_seed(seed: int | None, *, purpose: str = "noise") -> int:
    """Return ``seed``, or 63 bits of OS entropy when it is None (the default)."""
    if seed is None:
        return secrets.randbits(63)
    if seed < 0:
        raise ValueError(f"{purpose} seed must be non-negative, got {seed}")
    _log.warning(
        "using the fixed %s seed %d: the DP randomness is reproducible by anyone who "
        "knows it; use a fixed seed for debugging and tests only",
        purpose,
        seed,
    )
    return seed
