"""The RDP accountant with the truncated step: dp-accounting's own wherever dp-accounting has an answer."""

import dp_accounting
import numpy as np
import pytest

from dpscale.privacy.accounting import RdpParts, Truncation, dp_event, rdp_epsilon
from dpscale.privacy.rdp_accountant import RdpAccountant
from dpscale.privacy.repetitions import Repetitions
from dpscale.privacy.selection import run_event, selection_event


def _stock(event):
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(event)
    return accountant


def test_every_event_dp_accounting_knows_is_accounted_as_dp_accounting_does():
    run = run_event(noise_multiplier=1.3, sampling_rate=0.02, steps=300, score_noise=8.0, releases=(20.0,))
    for event in (run, selection_event(run, Repetitions(mean=7.0)), selection_event(run, Repetitions("poisson", 7.0))):
        ours = RdpAccountant().compose(event)
        assert np.array_equal(ours._rdp, _stock(event)._rdp)
        assert ours.get_epsilon(1e-6) == _stock(event).get_epsilon(1e-6)


def test_the_truncated_step_is_accounting_truncated_step_rdp_and_only_that():
    truncation = Truncation(num_examples=2000, capacity=60)  # q N = 40: truncated often enough to matter
    steps = 200
    event = dp_event(noise_multiplier=0.9, sampling_rate=0.02, steps=steps, truncation=truncation)
    ours = RdpAccountant().compose(event)
    parts = RdpParts.of(noise_multiplier=0.9, sampling_rate=0.02, truncation=truncation)
    assert np.array_equal(ours._orders, parts.orders)
    assert np.allclose(ours._rdp, steps * parts.step, rtol=0, atol=0)
    assert (parts.step >= parts.untruncated).all() and (parts.step > parts.untruncated).any()
    # Not rdp_epsilon's second bound (the untruncated steps at delta minus the charge): an RDP curve only.
    curve_only = float(dp_accounting.rdp.compute_epsilon(parts.orders, steps * parts.step, 1e-5)[0])
    assert ours.get_epsilon(1e-5) == pytest.approx(curve_only, rel=1e-12)
    assert rdp_epsilon([(parts, steps)], 1e-5) <= curve_only
    # Without truncation (capacity N + 1) it is the stock Poisson step.
    whole = dp_event(noise_multiplier=0.9, sampling_rate=0.02, steps=steps, truncation=Truncation(2000, 2001))
    plain = dp_event(noise_multiplier=0.9, sampling_rate=0.02, steps=steps)
    assert np.array_equal(RdpAccountant().compose(whole)._rdp, _stock(plain)._rdp)


def test_a_truncated_event_dp_accountings_rdp_accountant_refuses_is_composed_here():
    event = dp_event(noise_multiplier=1.0, sampling_rate=0.1, steps=10, truncation=Truncation(1000, 140))
    assert not dp_accounting.rdp.RdpAccountant().supports(event)
    assert RdpAccountant().supports(event)
    assert np.isfinite(RdpAccountant().compose(event).get_epsilon(1e-5))
