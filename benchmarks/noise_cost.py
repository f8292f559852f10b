"""What the lattice-free noise costs in the DP step (run by hand, on an idle machine).

``privacy/noise.py`` draws each noise value as the sum of ``SUMMANDS`` normals and rounds the
noisy parameters to a fine grid, instead of one ``jax.random.normal`` draw. This times the
DP step that ``dpscale train`` runs (the peers benchmark's step: per-layer clipped sum,
noise once per logical batch, SGD, EMA) both ways::

    python -m benchmarks.noise_cost --workload wrn-16-4 --physical 16 --logical 32 --repeats 21

The noise is drawn only in ``DpsgdStep.apply`` (noise, optimiser, EMA: once per logical
batch); the accumulation of clipped sums is the same code for both. Whole steps vary by ~10%
from one to the next on 2 cores, far more than the noise's share, so the two parts are timed
separately: ``apply`` many times for each noise, alternating so that drift in the machine's
load hits both alike, and the accumulation once per repeat. The step's ratio is
``(accumulate + apply with the secure noise) / (accumulate + apply with one draw)`` from the
medians; the alternated whole steps are reported too, with the quartiles of their pairwise ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _single_draw_noise(tree, key, *, std):
    """The former noise: one float32 normal draw per value, no rounding (the lattice)."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noisy = [x + std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, noisy)


class _Step:
    """The DP step with ``noise_fn`` in place of ``add_gaussian_noise`` (read when traced)."""

    def __init__(self, args, noise_fn) -> None:
        import jax
        import optax

        from benchmarks.peers_run_jax import _problem
        from dpscale.privacy import dpsgd
        from dpscale.privacy.ghost import make_ghost_clipped_sum_fn
        from dpscale.privacy.plan import PrivacyPlan
        from dpscale.privacy.tuning.choose import chooser
        from dpscale.training.config import TrainingConfig

        dpsgd.add_gaussian_noise = noise_fn
        loss_fn, params, self.batches, linear = _problem(args.workload, args.physical, args.logical // args.physical)
        if linear:
            raise SystemExit("this benchmark times the image workloads' per-layer clipped step")
        example = (params, {}, self.batches[0][0])
        clipped = make_ghost_clipped_sum_fn(
            loss_fn, clip_norm=1.0, example=example, choose=chooser(loss_fn, example=example)
        )
        plan = PrivacyPlan(
            num_examples=args.logical,
            batch_size=args.logical,
            steps=1,
            delta=1e-5,
            noise_multiplier=args.noise_multiplier,
        )
        self.dp = plan.dp_step(
            loss_fn,
            seed=0,
            clip_norm=1.0,
            optimizer=optax.sgd(0.1),
            ema_decay=TrainingConfig.ema_decay,
            clipped_sum=lambda clip_norm: clipped,
        )
        self.state = self.dp.init(params)
        self._copy = jax.jit(lambda tree: jax.tree_util.tree_map(lambda x: x + 0, tree))
        for _ in range(2):  # compile, then one warm step
            self.apply(self.accumulate())
            self.whole()

    def accumulate(self):
        import jax

        total = self.dp.zero_sum(self.state)
        for batch, mask in self.batches:
            total = self.dp.accumulate(self.state, total, batch, mask)
        return jax.block_until_ready(total)

    def apply(self, total) -> None:
        import jax

        self.state, metrics = self.dp.apply(self.state, total)
        jax.block_until_ready((self.state.params, metrics))

    def fresh(self, total):
        """A copy of ``total`` (``apply`` donates its input)."""
        import jax

        return jax.block_until_ready(self._copy(total))

    def whole(self) -> None:
        import jax

        self.state, metrics = self.dp.update(self.state, self.batches)
        jax.block_until_ready((self.state.params, metrics))


def _timed(fn, *args) -> tuple[float, float]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall0, time.process_time() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="wrn-16-4")
    parser.add_argument("--physical", type=int, default=16)
    parser.add_argument("--logical", type=int, default=32)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=21, help="whole steps and accumulations per variant")
    parser.add_argument("--apply-repeats", type=int, default=5, help="applies per variant per repeat")
    args = parser.parse_args()

    from dpscale.privacy import noise

    secure, single = f"secure (sum of {noise.SUMMANDS}, grid 2^-{noise.GRID_BITS})", "single draw (former)"
    steps = {secure: _Step(args, noise.add_gaussian_noise), single: _Step(args, _single_draw_noise)}
    total = steps[secure].accumulate()
    accumulate_wall, accumulate_cpu = [], []
    apply_wall = {name: [] for name in steps}
    apply_cpu = {name: [] for name in steps}
    whole_wall = {name: [] for name in steps}
    for _ in range(args.repeats):
        wall, cpu = _timed(steps[secure].accumulate)
        accumulate_wall.append(wall)
        accumulate_cpu.append(cpu)
        for _ in range(args.apply_repeats):
            for name, step in steps.items():
                wall, cpu = _timed(step.apply, step.fresh(total))
                apply_wall[name].append(wall)
                apply_cpu[name].append(cpu)
        for name, step in steps.items():
            whole_wall[name].append(_timed(step.whole)[0])

    med = statistics.median
    acc_w, acc_c = med(accumulate_wall), med(accumulate_cpu)
    result = {
        "accumulate": {"wall_s": round(acc_w, 4), "cpu_s": round(acc_c, 4)},
        "apply": {
            name: {"wall_s": round(med(apply_wall[name]), 4), "cpu_s": round(med(apply_cpu[name]), 4)} for name in steps
        },
    }
    result["step_wall_ratio"] = round((acc_w + med(apply_wall[secure])) / (acc_w + med(apply_wall[single])), 4)
    result["step_cpu_ratio"] = round((acc_c + med(apply_cpu[secure])) / (acc_c + med(apply_cpu[single])), 4)
    result["noise_extra_ms"] = round(1e3 * (med(apply_wall[secure]) - med(apply_wall[single])), 1)
    paired = [a / b for a, b in zip(whole_wall[secure], whole_wall[single])]
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    result["whole_steps"] = {name: round(med(whole_wall[name]), 4) for name in steps} | {
        "wall_ratio_of_medians": round(med(whole_wall[secure]) / med(whole_wall[single]), 4),
        "pairwise_ratio_quartiles": [round(q, 4) for q in quartiles],
    }
    result |= {
        "workload": args.workload,
        "physical": args.physical,
        "logical": args.logical,
        "repeats": args.repeats,
        "apply_repeats": args.apply_repeats,
        "load1_at_end": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
