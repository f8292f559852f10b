"""Secret randomness: fresh entropy by default, a fixed seed is logged."""

import logging

import pytest

from dpscale.privacy.seeds import resolve_seed


def test_default_seed_is_fresh_entropy():
    seeds = {resolve_seed(None) for _ in range(20)}
    assert len(seeds) == 20
    assert all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) >= 2**32  # more than 32 bits are used


def test_fixed_seed_is_kept_and_logged(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_seed(42, purpose="noise") == 42
    assert "fixed noise seed 42" in caplog.text


def test_negative_seed_is_rejected():
    with pytest.raises(ValueError):
        resolve_seed(-1)
