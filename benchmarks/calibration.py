"""Wall time of calibration for an ImageNet-sized run, RDP and PLD (by hand).

N = 1,281,167 examples, B = 16,384, T = 71,589 steps, delta = 8e-7 (De et al. 2022).
For each accountant and target epsilon, solves for each of the three knobs in turn
(the other two fixed at the values above; the noise multiplier fixed at the one
calibrated for that target) and reports the time, the number of accountant probes and
the achieved epsilon. Each case runs ``--repeats`` times in a fresh cache
(``calibration.clear_caches``: every answer, curve and one-step RDP forgotten); the best
and the median are reported, plus the 1-minute load average (the machine is shared).
Rows "plan" time ``PrivacyPlan.calibrate``, what ``dpscale calibrate`` and ``train`` run: the
same search, then the batch capacity's choice and the search again with truncated batches.

    python -m benchmarks.calibration --repeats 2        # prints the table; --output FILE writes it too

The figures that stand go, with the command and the commit, into the table at the top of
``benchmarks/results/calibration.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from dpscale.privacy import calibration
from dpscale.privacy.plan import PrivacyPlan, PrivacyTarget

N, B, T, DELTA = 1_281_167, 16_384, 71_589, 8e-7


def _time(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        calibration.clear_caches()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="8,1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="Markdown file to write the table to.")
    args = parser.parse_args()

    rows = []
    for accountant in ("rdp", "pld"):
        for target in (float(t) for t in args.targets.split(",")):
            common = dict(target_epsilon=target, delta=DELTA, accountant=accountant)
            first = len(rows)
            best, median, found = _time(
                lambda: calibration.calibrate_noise_multiplier(sampling_rate=B / N, steps=T, **common), args.repeats
            )
            sigma = found.value
            rows.append((accountant, target, "noise multiplier", f"{sigma:.5f}", found, best, median))
            best, median, res = _time(
                lambda: calibration.calibrate_steps(noise_multiplier=sigma, sampling_rate=B / N, **common), args.repeats
            )
            rows.append((accountant, target, "steps", str(res.value), res, best, median))
            best, median, res = _time(
                lambda: calibration.calibrate_batch_size(noise_multiplier=sigma, steps=T, num_examples=N, **common),
                args.repeats,
            )
            rows.append((accountant, target, "batch size", str(res.value), res, best, median))
            if accountant == "pld" and target == 8.0:  # what `dpscale calibrate` runs (truncated batches)
                plan_target = PrivacyTarget(target, DELTA, accountant)
                for knob, given in (
                    ("noise multiplier", dict(batch_size=B, steps=T)),
                    ("batch size", dict(noise_multiplier=sigma, steps=T)),
                ):
                    best, median, plan = _time(
                        lambda: PrivacyPlan.calibrate(plan_target, num_examples=N, **given), args.repeats
                    )
                    value = f"{plan.noise_multiplier:.5f}" if knob == "noise multiplier" else str(plan.batch_size)
                    rows.append(
                        (
                            accountant,
                            target,
                            f"{knob} (plan)",
                            value,
                            calibration.Calibrated(value=0, epsilon=plan.epsilon(), probes=0),
                            best,
                            median,
                        )
                    )
            for row in rows[first:]:
                print(
                    f"{row[0]} eps={row[1]:g} {row[2]}={row[3]} achieved={row[4].epsilon:.6f} "
                    f"probes={row[4].probes} best={row[5]:.2f}s median={row[6]:.2f}s",
                    flush=True,
                )

    load = os.getloadavg()[0]
    lines = [
        "# Calibration time, ImageNet-sized run",
        "",
        f"N = {N:,}, B = {B:,}, T = {T:,}, delta = {DELTA:g}; Python {sys.version.split()[0]}, "
        f"1-min load average at the end: {load:.1f} (2 shared cores).",
        "",
        f"Command: `python -m benchmarks.calibration {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        "| accountant | target eps | solved for | value | achieved eps | probes | best s | median s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for acc, target, knob, value, res, best, median in rows:
        lines.append(
            f"| {acc} | {target:g} | {knob} | {value} | {res.epsilon:.6f} | {res.probes} | {best:.2f} | {median:.2f} |"
        )
    lines += [
        "",
        "Probes count every accountant evaluation of the search (for PLD: the RDP and coarse-grid PLD "
        "pre-solves plus the PLD probes); the final standard-accountant check reuses the last probe. "
        '"(plan)" rows: `PrivacyPlan.calibrate`, as `dpscale calibrate` runs it (the search, the batch '
        "capacity's choice, the search again with truncated batches; probes not counted, shown as 0).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
