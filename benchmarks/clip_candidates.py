"""Which clipping candidates a GPU would time, from shapes alone (no device, nothing compiled).

    python -m benchmarks.clip_candidates count --model wrn-16-4 --microbatch 256 --views 1,4
    python -m benchmarks.clip_candidates fit

``count``: each distinct layer shape of the model at one device's micro-batch, with the GPU's settings
(``privacy.tuning.device``) forced and its candidates timed (``choose="measure"``; by default a GPU
takes the cost model's cheapest and times none): the candidates timed (each a compilation), those pruned by the cost
model or dropped by the memory guard, and those chunked. ``--memory`` is the device's ``bytes_limit``
(default: an H200's as JAX sees it, 0.75 of 141 GB). ``fit``: the cost model's estimate of each
candidate against the H200's timings it was fitted to (benchmarks/results/gpu_step_cost.md), as
ratios to each layer's cheapest.
"""

from __future__ import annotations

import argparse

# (positions, fan-in, fan-out): {candidate: ms}, one H200, micro-batch 256 (gpu_step_cost.md).
H200_MS = {
    "stem": ((1024, 27, 16), {"explicit/tf32": 0.20, "explicit/highest": 0.24, "streamed": 0.36, "ghost": 2.34}),
    "stage 1 shortcut": (
        (1024, 16, 64),
        {"explicit/tf32": 0.32, "explicit/highest": 0.27, "streamed": 0.43, "ghost": 2.74},
    ),
    "stage 1 conv": (
        (1024, 576, 64),
        {"explicit/tf32": 0.94, "explicit/highest": 1.18, "streamed": 2.17, "ghost": 10.40},
    ),
    "stage 2 conv": (
        (256, 1152, 128),
        {"explicit/tf32": 0.89, "explicit/highest": 1.28, "streamed": 1.50, "ghost": 2.23},
    ),
    "stage 3 conv": (
        (64, 2304, 256),
        {"explicit/tf32": 2.15, "explicit/highest": 2.40, "streamed": 2.12, "ghost": 0.97},
    ),
    "head": ((1, 256, 10), {"explicit/tf32": 0.24, "explicit/highest": 0.27, "streamed": 0.25, "ghost": 0.20}),
    "stage 1 conv, K = 4": ((4096, 576, 64), {"explicit/tf32": 2.3, "ghost": 131.0}),
    "stage 3 conv, K = 4": ((256, 2304, 256), {"explicit/tf32": 2.57, "ghost": 3.99}),
}


def count(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    from dpscale.models import registry
    from dpscale.privacy import bookkeeping
    from dpscale.privacy.tuning import timing as path_timing
    from dpscale.privacy.tuning.choose import timed_calls
    from dpscale.privacy.tuning.device import MEMORY_FRACTION, tuning_for

    tuning = tuning_for("gpu")
    budget = int(MEMORY_FRACTION * args.memory)
    model = registry.get_model(args.model, num_classes=10)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"])

    def loss_fn(params, model_state, views):
        logits = model.apply({"params": params}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    for views in map(int, args.views.split(",")):
        batch = {
            "image": jax.ShapeDtypeStruct((args.microbatch, views, 32, 32, 3), jnp.float32),
            "label": jax.ShapeDtypeStruct((args.microbatch, views), jnp.int32),
        }
        calls = bookkeeping.plan_batch_layers(loss_fn, params, {}, batch)
        _, _, groups = path_timing.candidate_groups(
            loss_fn, calls, timed_calls(calls, {}), params, {}, batch, tuning, budget=budget
        )
        timed = sum(len(g.candidates.timed) for g in groups)
        print(f"\n{args.model}, micro-batch {args.microbatch}, K = {views}, budget {budget / 1e9:.1f} GB:")
        for g in groups:
            s = g.shape
            shown = ", ".join(
                f"{path_timing.candidate_name(c.strategy, c.precision)} {c.seconds * 1e3:.2f} ms"
                + (f" [{s.examples // c.chunk} chunks]" if c.chunk < s.examples else "")
                for c in g.candidates.timed
            )
            out = "; ".join(f"{n} {why}" for n, why in g.candidates.left_out)
            print(
                f"  ({s.positions}, {s.fan_in} -> {s.fan_out}) x{len(g.indices)}: {shown}" + (f"; {out}" if out else "")
            )
        total = len(groups) * len(tuning.candidates)
        print(f"  {len(groups)} layer shapes: {timed} of {total} candidates compiled ({total - timed} saved)")


def fit(args: argparse.Namespace) -> None:
    from dpscale.privacy.ghost import LayerShape
    from dpscale.privacy.rounding import ClipPrecision
    from dpscale.privacy.tuning import cost as path_cost
    from dpscale.privacy.tuning.device import H200_COST

    worst = 1.0
    for layer, ((positions, d, p), ms) in H200_MS.items():
        shape = LayerShape(256, positions, d, p)
        est = {}
        for name in ms:
            strategy, _, fmt = name.partition("/")
            est[name] = path_cost.estimate(
                strategy, ClipPrecision(fmt or "highest", fmt or "highest"), shape, 256, H200_COST
            )
        cheapest_ms, cheapest_est = min(ms.values()), min(est.values())
        rows = []
        for name in ms:
            measured, model = ms[name] / cheapest_ms, est[name] / cheapest_est
            worst = max(worst, model / measured, measured / model)
            rows.append(f"{name} {measured:.1f}x (model {model:.1f}x, {est[name] * 1e3:.2f} ms)")
        print(f"{layer} ({positions}, {d} -> {p}): " + ", ".join(rows))
    print(f"model / measured ratio to the cheapest: within {worst:.2f}x either way")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("count")
    c.add_argument("--model", default="wrn-16-4")
    c.add_argument("--microbatch", type=int, default=256)
    c.add_argument("--views", default="1,4")
    c.add_argument("--memory", type=float, default=0.75 * 141e9)
    c.set_defaults(run=count)
    sub.add_parser("fit").set_defaults(run=fit)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
