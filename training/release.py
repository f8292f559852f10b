"""What a training run may publish, decided in one place.

A run's (epsilon, delta) covers the noisy updates and anything computed from them alone
(parameters, EMA parameters, the norm of the noisy update), plus what does not depend on the
private data at all (the configuration, the plan and its epsilon, step numbers, a run's total
wall time). Everything else a run could report about its private batches is a *private
diagnostic*: the loss, gradient norms, the clipped fraction, the realised batch size, the count
of non-finite gradients, scores on rows of the private training data (``holdout``), and the
per-step wall time (every step has the same shape and code path, but a step's time is still a
measurement taken while it read private rows, so it is not published step by step). They are statistics of
the private data without noise; a canary with a NaN or a huge gradient shows up in them with
certainty. So they are off by default. With ``private_diagnostics`` they go to files whose
name says so, readable by the owner only (0600), and the run warns once; they never reach the
default outputs (``metrics.jsonl``, the progress bar, the result line, sweep tables, plots,
exported backbones). A non-private run (epsilon = inf) has no guarantee to protect: all its
statistics are ordinary outputs.
"""

from __future__ import annotations

from typing import Any

#: Per-step fields covered by epsilon: post-processing of the noisy update, or data-independent.
#: Every other per-step field (loss, gradient norms, ...) is a private diagnostic.
COVERED_STEP_FIELDS = ("step", "epsilon_spent", "update_norm")
#: The file name of every private diagnostic says it is not private.
NOT_PRIVATE = "NOT-PRIVATE"
DIAGNOSTICS_FILE = f"diagnostics.{NOT_PRIVATE}.jsonl"
#: A TAN simulation (``sweep --simulate-batch``) is DP only at its own, larger epsilon, not its target's:
#: its directory holds ``SIMULATION_FILE`` (what it simulates) from before its first step, and every
#: JSON file and line it writes carries ``SIMULATED`` (``training.run_directory``).
SIMULATION_NOTE = "simulation: not the privacy of the target"
SIMULATION_FILE = f"simulation.{NOT_PRIVATE}.json"
SIMULATED = "simulated"


def diagnostic_name(name: str) -> str:
    """``summary.md`` -> ``summary.NOT-PRIVATE.md``: the name a file gets when it holds diagnostics."""
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.{NOT_PRIVATE}.{suffix}" if dot else f"{name}.{NOT_PRIVATE}"


def warning(what: str) -> str:
    """The one-line warning printed when a private diagnostic is written or shown."""
    return (
        f"{what} holds statistics of the private training data that epsilon does NOT cover "
        "(private diagnostics); keep it to yourself (written with mode 0600)"
    )


def split_step_metrics(metrics: dict[str, Any], *, private: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(covered, diagnostic) parts of one step's metrics; a non-private run's are all covered."""
    if not private:
        return dict(metrics), {}
    covered = {k: v for k, v in metrics.items() if k in COVERED_STEP_FIELDS}
    diagnostic = {k: v for k, v in metrics.items() if k not in COVERED_STEP_FIELDS}
    if diagnostic:
        diagnostic["step"] = metrics["step"]
    return covered, diagnostic
