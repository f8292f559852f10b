"""What the lattice-free noise costs in the DP step (run by hand, on an idle machine).

``privacy/noise.py`` draws each noise value as the sum of ``SUMMANDS`` normals and rounds the
noisy parameters to a fine grid, instead of one ``jax.random.normal`` draw. This times the
DP step that ``dpscale train`` runs (the peers benchmark's step: book-keeping clipped sum,
noise once per logical batch, SGD, EMA) both ways, alternating the two so that drift in the
machine's load hits both alike, and reports the median CPU and wall seconds per step::

    python -m benchmarks.noise_cost --workload wrn-16-4 --physical 16 --logical 32 --repeats 7
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


def _build(args, noise_fn):
    """The step with ``noise_fn`` in place of ``add_gaussian_noise`` (read when the step is traced)."""
    from benchmarks.peers_run_jax import _dpscale_step, _problem
    from dpscale.privacy import dpsgd

    dpsgd.add_gaussian_noise = noise_fn
    loss_fn, params, batches, linear = _problem(args.workload, args.physical, args.logical // args.physical)
    args.framework = "dpscale"
    step = _dpscale_step(args, loss_fn, params, batches, linear)
    for _ in range(2):  # compile, then one warm step
        step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="wrn-16-4")
    parser.add_argument("--physical", type=int, default=16)
    parser.add_argument("--logical", type=int, default=32)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from dpscale.privacy import noise

    steps = {"secure (sum of %d, grid 2^-%d)" % (noise.SUMMANDS, noise.GRID_BITS): _build(args, noise.add_gaussian_noise),
             "single draw (former)": _build(args, _single_draw_noise)}
    cpu = {name: [] for name in steps}
    wall = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            wall0, cpu0 = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - wall0)
            cpu[name].append(time.process_time() - cpu0)
    secure, single = steps
    result = {name: {"cpu_s": statistics.median(cpu[name]), "wall_s": statistics.median(wall[name])} for name in steps}
    result["cpu_ratio"] = result[secure]["cpu_s"] / result[single]["cpu_s"]
    result["wall_ratio"] = result[secure]["wall_s"] / result[single]["wall_s"]
    result |= {"workload": args.workload, "physical": args.physical, "logical": args.logical,
               "repeats": args.repeats, "load1_at_end": os.getloadavg()[0]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
