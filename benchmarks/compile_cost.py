"""One-off: how long the DP micro-batch program takes to lower and compile against the non-private one.

    python benchmarks/compile_cost.py wrn-16-4 256 cuda     # an accelerator's clip settings, forced on a CPU

Prints one JSON line: seconds to lower and to compile ``DpsgdStep.accumulate_traceable`` (the
program ``dpscale train`` runs per micro-batch) for each kind of run, and the optimised program's
loops, dot products, convolutions and fusions. Synthetic inputs (``benchmarks.peers_run_jax``).
"""

import json
import re
import sys
import time

import jax
import optax

from benchmarks.peers_run_jax import _problem
from dpscale.privacy.device_tuning import NAMED_TUNING
from dpscale.privacy.ghost import describe, make_ghost_clipped_sum_fn
from dpscale.privacy.plan import PrivacyPlan


def main() -> None:
    workload, physical, tuning_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    loss_fn, params, batches, _ = _problem(workload, physical, 1)
    batch, mask = batches[0]
    out: dict = {"workload": workload, "physical": physical, "tuning": tuning_name}
    for kind in ("nonprivate", "dp"):
        clipped = None
        if kind == "dp":
            tuning = NAMED_TUNING[tuning_name]
            clipped = make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=tuning)
            out["paths"] = describe(clipped.layers)
        sigma = 1.0 if kind == "dp" else 0.0
        plan = PrivacyPlan(num_examples=physical, batch_size=physical, steps=1, delta=1e-5, noise_multiplier=sigma)
        step = plan.dp_step(
            loss_fn, seed=0, clip_norm=1.0, optimizer=optax.sgd(0.1), ema_decay=0.999, clipped_sum_fn=clipped
        )
        state = step.init(params)
        start = time.perf_counter()
        lowered = jax.jit(step.accumulate_traceable).lower(
            state.params, step.zero_sum(state), batch, mask, state.model_state
        )
        lowered_at = time.perf_counter()
        text = lowered.compile().as_text()
        out[kind] = {
            "lower_s": round(lowered_at - start, 2),
            "compile_s": round(time.perf_counter() - lowered_at, 2),
            **{op: len(re.findall(rf" {op}\(", text)) for op in ("while", "dot", "convolution", "fusion")},
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
