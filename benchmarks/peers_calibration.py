"""Noise calibration for an ImageNet-sized run in one framework; prints JSON lines.

N = 1,281,167, B = 16,384 (q = B/N), T = 71,589 steps, delta = 8e-7, epsilon 8 and 1.
``dpscale`` runs ``calibrate_noise_multiplier`` with its PLD and RDP accountants (run
with /work/venv); ``opacus`` runs ``opacus.accountants.utils.get_noise_multiplier`` with
each accountant it has (run with the peers virtualenv). One fresh call per case, timed.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.peers_measure import emit

N, B, T, DELTA = 1_281_167, 16_384, 71_589, 8e-7
TARGETS = (8.0, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("dpscale", "opacus"), required=True)
    args = parser.parse_args()
    q = B / N
    if args.framework == "dpscale":
        from dpscale.privacy.calibration import calibrate_noise_multiplier

        for accountant in ("pld", "rdp"):
            for eps in TARGETS:
                start = time.perf_counter()
                found = calibrate_noise_multiplier(
                    target_epsilon=eps, delta=DELTA, sampling_rate=q, steps=T, accountant=accountant
                )
                emit(
                    {
                        "framework": "dpscale",
                        "accountant": accountant,
                        "target": eps,
                        "sigma": found.value,
                        "epsilon": found.epsilon,
                        "probes": found.probes,
                        "seconds": time.perf_counter() - start,
                    }
                )
        return
    import opacus
    from opacus.accountants.utils import get_noise_multiplier

    for accountant in ("rdp", "prv", "gdp"):
        for eps in TARGETS:
            start = time.perf_counter()
            try:
                sigma = get_noise_multiplier(
                    target_epsilon=eps, target_delta=DELTA, sample_rate=q, steps=T, accountant=accountant
                )
                result = {"sigma": float(sigma)}
            except Exception as err:  # noqa: BLE001  an accountant may be missing or fail at this size
                result = {"error": f"{type(err).__name__}: {err}"[:200]}
            emit(
                {
                    "framework": f"opacus {opacus.__version__}",
                    "accountant": accountant,
                    "target": eps,
                    "seconds": time.perf_counter() - start,
                    **result,
                }
            )


if __name__ == "__main__":
    main()
