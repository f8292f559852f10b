"""One-off: WRN-16-4's clipped sum of one micro-batch, CPU settings: XLA temp MB, min time of 3 calls.

Run at two commits (a `git archive` copy each) and alternate them:

    python -m benchmarks.clipped_sum_ab 52 4     # micro-batch, K
"""

import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.peers_run_jax import _problem
from dpscale.privacy import ghost
from dpscale.privacy.device_tuning import tuning_for

mb, views = int(sys.argv[1]), int(sys.argv[2])
loss_fn, params, batches, _ = _problem("wrn-16-4", mb, 1)
batch, mask = batches[0]
batch = {**batch, "image": jnp.repeat(batch["image"], views, axis=1), "label": jnp.repeat(batch["label"], views, 1)}
fn = ghost.make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=(params, {}, batch), tuning=tuning_for("cpu"))


def f(p, b, m):
    return fn(p, {}, b, m)


c = jax.jit(f).lower(params, batch, mask).compile()
temp = c.memory_analysis().temp_size_in_bytes / 2**20
jax.block_until_ready(c(params, batch, mask))
ts = []
for _ in range(3):
    t = time.perf_counter()
    jax.block_until_ready(c(params, batch, mask))
    ts.append(time.perf_counter() - t)
print(
    f"{ghost.__file__} K={views}: temp {temp:.1f} MB, clipped sum {min(ts) * 1e3:.0f} ms (all {[round(t * 1e3) for t in ts]})",
    flush=True,
)
