"""Examples/s of the per-example-gradient DP step vs the plain batched step (run by hand).

For each model and physical batch size, times three jitted training steps (gradient + SGD
update, parameters donated):

* ``non-private`` -- ``grad`` of the batch-mean loss;
* ``dp-contract`` -- ``vmap(grad)`` over single examples, per-example norms computed first,
  then the clipped sum formed as one weighted contraction ``sum_i s_i g_i`` with
  ``s_i = min(1, C / ||g_i||)`` (non-finite norms get ``s_i = 0``), plus Gaussian noise;
* ``dp-clip-in-vmap`` -- the naive form: clip each gradient inside ``vmap``, then sum.

Usage (2 host devices split the batch; set before JAX starts, hence the flag here)::

    python -m benchmarks.model_throughput --devices 2 --model wrn-16-4 --batch-sizes 16,32
    python -m benchmarks.model_throughput --devices 1 --model cnn-small --batch-sizes 128,512

Each run appends a section with its command to ``--output`` (default: a scratch file under the system's
temporary directory); the figures that stand go into the table at the top of
``benchmarks/results/model_throughput.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

RUNS = Path(tempfile.gettempdir()) / "dpscale-benchmarks" / "model_throughput.md"


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="registry name (repeatable)")
    parser.add_argument("--batch-sizes", default="32", help="comma-separated physical batch sizes")
    parser.add_argument("--devices", type=int, default=1, help="host CPU devices to split the batch over")
    parser.add_argument("--modes", default="non-private,dp-contract,dp-clip-in-vmap")
    parser.add_argument("--min-seconds", type=float, default=6.0, help="timing budget per config")
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RUNS)
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:  # must happen before jax initialises its backend
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from dpscale.models.registry import get_model, get_spec, param_count  # noqa: E402

CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 0.1


def _loss(model, params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(model, mode: str, batch: int):
    """A jitted ``(params, x, y, key) -> params`` step for one of the three modes."""

    def single_loss(params, xi, yi):
        return _loss(model, params, xi[None], yi[None])

    def per_example_grads(params, x, y):
        return jax.vmap(jax.grad(single_loss), in_axes=(None, 0, 0))(params, x, y)

    def noisy_mean(summed, key):
        leaves, tree = jax.tree.flatten(summed)
        keys = jax.random.split(key, len(leaves))
        noisy = [
            g + NOISE_MULTIPLIER * CLIP_NORM * jax.random.normal(k, g.shape, g.dtype) for g, k in zip(leaves, keys)
        ]
        return jax.tree.unflatten(tree, [g / batch for g in noisy])

    if mode == "non-private":

        def grads(params, x, y, key):
            del key
            return jax.grad(lambda p: _loss(model, p, x, y))(params)
    elif mode == "dp-contract":

        def grads(params, x, y, key):
            g = per_example_grads(params, x, y)
            sq = sum(jnp.sum(jnp.square(leaf.reshape(batch, -1)), axis=1) for leaf in jax.tree.leaves(g))
            norms = jnp.sqrt(sq)
            scales = jnp.minimum(1.0, CLIP_NORM / jnp.maximum(norms, 1e-12))
            scales = jnp.where(jnp.isfinite(norms), scales, 0.0)
            summed = jax.tree.map(lambda leaf: jnp.tensordot(scales, leaf, axes=1), g)
            return noisy_mean(summed, key)
    elif mode == "dp-clip-in-vmap":

        def grads(params, x, y, key):
            def clipped(params, xi, yi):
                g = jax.grad(single_loss)(params, xi, yi)
                norm = optax.global_norm(g)
                return jax.tree.map(lambda leaf: leaf * jnp.minimum(1.0, CLIP_NORM / (norm + 1e-12)), g)

            g = jax.vmap(clipped, in_axes=(None, 0, 0))(params, x, y)
            return noisy_mean(jax.tree.map(lambda leaf: leaf.sum(axis=0), g), key)
    else:
        raise SystemExit(f"unknown mode {mode!r}")

    def step(params, x, y, key):
        g = grads(params, x, y, key)
        return jax.tree.map(lambda p, d: p - LEARNING_RATE * d, params, g)

    return jax.jit(step, donate_argnums=(0,))


def time_config(name: str, mode: str, batch: int, mesh) -> tuple[float, float, float]:
    """(examples per wall second, examples per process-CPU second, compile seconds).

    The CPU-time figure (all threads of this process) is the steadier one when other jobs
    share the cores; the wall-clock one is what a user sees.
    """
    spec = get_spec(name)
    model = get_model(name)
    data_sharding = NamedSharding(mesh, PartitionSpec("batch"))
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.random.key(0)
    x = jax.device_put(jax.random.normal(key, (batch, *spec.input_shape)), data_sharding)
    y = jax.device_put(jnp.arange(batch) % spec.num_classes, data_sharding)
    params = jax.device_put(jax.jit(model.init)(key, x[:1])["params"], replicated)
    step = make_step(model, mode, batch)
    start = time.perf_counter()
    params = jax.block_until_ready(step(params, x, y, jax.random.key(1)))
    compile_s = time.perf_counter() - start
    steps, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while steps < ARGS.min_steps or time.perf_counter() - start < ARGS.min_seconds:
        params = step(params, x, y, jax.random.key(2 + steps))
        jax.block_until_ready(params)
        steps += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return steps * batch / wall, steps * batch / cpu, compile_s


def main() -> None:
    devices = jax.devices()[: ARGS.devices]
    mesh = jax.sharding.Mesh(devices, ("batch",))
    modes = ARGS.modes.split(",")
    rows = []
    for name in ARGS.model:
        for batch in (int(b) for b in ARGS.batch_sizes.split(",")):
            if batch % len(devices):
                raise SystemExit(f"batch {batch} is not divisible by {len(devices)} devices")
            speeds, cpu_speeds = {}, {}
            for mode in modes:
                speeds[mode], cpu_speeds[mode], compile_s = time_config(name, mode, batch, mesh)
                print(
                    f"{name} b={batch} devices={len(devices)} {mode}: {speeds[mode]:,.1f} ex/s, "
                    f"{cpu_speeds[mode]:,.1f} ex/cpu-s (compile {compile_s:.1f} s)",
                    flush=True,
                )
            ratios = tuple(
                s["non-private"] / s["dp-contract"] if {"non-private", "dp-contract"} <= set(s) else float("nan")
                for s in (speeds, cpu_speeds)
            )
            rows.append((name, param_count(name), batch, len(devices), speeds, ratios))
    _write(rows, modes)


def _write(rows, modes) -> None:
    command = "python -m benchmarks.model_throughput " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {len(jax.devices())} host device(s)\n",
        f"Command: `{command}`  ",
        f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs (shared with other jobs: treat as indicative).\n",
        "| model | params | batch | devices | "
        + " | ".join(f"{m} ex/s" for m in modes)
        + " | slowdown (wall) | slowdown (CPU time) |",
        "|---|---:|---:|---:|" + "---:|" * len(modes) + "---:|---:|",
    ]
    for name, params, batch, n_dev, speeds, (ratio, cpu_ratio) in rows:
        cells = " | ".join(f"{speeds[m]:,.1f}" for m in modes)
        lines.append(f"| {name} | {params:,} | {batch} | {n_dev} | {cells} | {ratio:.2f} | {cpu_ratio:.2f} |")
    ARGS.output.parent.mkdir(parents=True, exist_ok=True)
    if not ARGS.output.exists():
        ARGS.output.write_text(
            "# Per-example-gradient DP step vs plain batched step\n\n"
            "Produced by `benchmarks/model_throughput.py` (see its docstring). `dp-contract` forms the "
            "clipped sum from per-example norms with one weighted contraction; `dp-clip-in-vmap` clips "
            "inside `vmap` then sums. All steps include the SGD update; DP steps include the noise. "
            "Slowdown = non-private / dp-contract throughput, from wall-clock time and from the "
            "process's CPU time (steadier when other jobs share the cores).\n"
        )
    with ARGS.output.open("a") as handle:
        handle.write("\n".join(lines) + "\n")
    print(f"appended to {ARGS.output}")


if __name__ == "__main__":
    main()
