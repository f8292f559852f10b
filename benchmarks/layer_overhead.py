"""One-off: where a DP micro-batch's extra time goes on the CPU, layer by layer.

python -m benchmarks.layer_overhead wrn-16-4 52 1     # model, micro-batch, K

Per distinct layer shape: each clip candidate (norm bounds + weighted sum, alone, random inputs)
against the layer's non-private weight gradient (its VJP for the batch); then the whole micro-batch:
non-private grad, the DP forward+backward to every layer's output (record_layers), the clipped sum.
Times are the minimum of a few calls (ms).
"""

import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.peers_run_jax import _problem
from dpscale.privacy import bookkeeping, ghost, path_timing
from dpscale.privacy.device_tuning import tuning_for
from dpscale.privacy.ghost import make_ghost_clipped_sum_fn


def best(fn, args, repeats=7):
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    out = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        out = min(out, time.perf_counter() - t)
    return out * 1e3


model, mb, views = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
loss_fn, params, batches, _ = _problem(model, mb, 1)
batch, mask = batches[0]
if views > 1:
    batch = {**batch, "image": jnp.repeat(batch["image"], views, axis=1), "label": jnp.repeat(batch["label"], views, 1)}
one = jax.tree_util.tree_map(lambda a: a[0], batch)
calls = bookkeeping.plan_layers(loss_fn, params, {}, one)
tuning = tuning_for("cpu")
timed = ghost.timed_calls(calls, {})
inputs, out_grads, groups = path_timing.candidate_groups(loss_fn, calls, timed, params, {}, batch, tuning, budget=2**62)
rng = np.random.default_rng(0)
total_np = total_chosen = total_best = 0.0
print(f"{model} micro-batch {mb} K {views}: per layer shape, ms (x count)")
for group in groups:
    call = calls[group.indices[0]]
    own = path_timing._random_like(bookkeeping.layer_params(call, params), rng)
    x = path_timing._random_like(inputs[group.indices[0]], rng)
    g = path_timing._random_like(out_grads[group.indices[0]], rng)
    w, fin = jnp.full((x.shape[0],), 0.5, jnp.float32), jnp.ones((x.shape[0],), bool)
    s = group.shape

    def weight_grad(own, x, g, module=call.module):
        def flat(a):
            return a.reshape(-1, *a.shape[2:])

        _, vjp = jax.vjp(lambda p: module.apply({"params": p}, flat(x)), own)
        return vjp(flat(g))[0]

    np_ms = best(weight_grad, (own, x, g))
    rule = ghost.choose_strategy(positions=s.positions, fan_in=s.fan_in, fan_out=s.fan_out)
    ms = {}
    for strategy in ("explicit", "streamed", "ghost"):
        fn = path_timing._layer_fn(call.module, strategy, tuning.precision, tuning.chunk_bytes)
        ms[strategy] = best(fn, (own, x, g, w, fin))
    n = len(group.indices)
    total_np += n * np_ms
    total_chosen += n * ms[rule]
    total_best += n * min(ms.values())
    print(
        f"  ({s.positions}, {s.fan_in} -> {s.fan_out}) x{n}: non-private wgrad {np_ms:.1f}; "
        + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
        + f"; rule {rule}"
    )
print(f"  sum: non-private wgrads {total_np:.0f}, rule's paths {total_chosen:.0f}, fastest paths {total_best:.0f}")

flat_batch = jax.tree_util.tree_map(lambda a: a.reshape(-1, *a.shape[2:]), batch)


def np_grad(p, b):
    def loss(p):
        return loss_fn(p, {}, b)

    return jax.grad(loss)(p)


def tape(p, b):
    t = bookkeeping.record_layers(loss_fn, calls, p, {}, b)
    return t.losses, t.inputs, t.out_grads


clipped = make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=tuning)
print(f"  whole micro-batch: non-private grad {best(np_grad, (params, flat_batch)):.0f}")
print(f"  DP forward+backward to layer outputs (record_layers) {best(tape, (params, batch)):.0f}")
print(f"  DP clipped sum {best(lambda p, b, m: clipped(p, {}, b, m), (params, batch, mask)):.0f}")
