"""dp-accounting's RDP accountant, taught the one event it lacks: dpscale's truncated Poisson step.

dp-accounting's ``RdpAccountant`` composes Gaussian, Poisson-subsampled Gaussian, composed,
self-composed and repeat-and-select events, but not ``TruncatedSubsampledGaussianDpEvent``
(only its PLD accountant has that one). Every DP-SGD step dpscale runs is that event
(``privacy.accounting.step_event``), and a private selection (``privacy.selection``) needs
``RepeatAndSelectDpEvent`` over runs of it, which only the RDP accountant supports. So this
subclass adds the truncated step's RDP, the per-order bound ``accounting.truncated_step_rdp``
proves for exactly that event, and leaves everything else to dp-accounting: composition,
repeat-and-select (Papernot & Steinke 2022) and the conversion to (epsilon, delta).

What it does *not* use: ``accounting.rdp_epsilon``'s second bound (the untruncated steps' RDP at
delta minus the truncation's probability). That is an (epsilon, delta) statement about one whole
run, not an RDP curve, so nothing built on a run's RDP curve (repeat-and-select) may rest on it.
Hand-written only where dp-accounting has no answer: dispatch is its own ``_maybe_compose``,
checked against its stock accountant in tests/privacy/test_rdp_accountant.py.
"""

from __future__ import annotations

import dp_accounting
import numpy as np

from dpscale.privacy.accounting import RdpParts, Truncation
from dpscale.privacy.pld import NEIGHBORING_RELATION


class RdpAccountant(dp_accounting.rdp.RdpAccountant):
    """dp-accounting's RDP accountant (add-or-remove-one, its default orders) plus the truncated step.

    The default orders are the ones ``accounting.truncated_step_rdp`` is computed on (it refuses others).
    """

    def __init__(self) -> None:
        super().__init__(neighboring_relation=NEIGHBORING_RELATION)

    def _maybe_compose(self, event: dp_accounting.DpEvent, count: int, do_compose: bool) -> object:
        if not isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
            return super()._maybe_compose(event, count, do_compose)
        if do_compose and count:  # 0 steps spend nothing, also at orders where one step's RDP is inf
            truncation = Truncation(num_examples=event.dataset_size - 1, capacity=event.truncated_batch_size)
            parts = RdpParts.of(
                noise_multiplier=event.noise_multiplier,
                sampling_rate=event.sampling_probability,
                truncation=truncation,
            )
            if not np.array_equal(parts.orders, self._orders):
                raise ValueError("RDP orders differ")  # both dp-accounting's defaults: a bug
            self._rdp = self._rdp + count * np.asarray(parts.step, dtype=float)
        return None
