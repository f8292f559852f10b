"""One-off: XLA's temporary memory (MB) of the clipped sum alone, NVIDIA settings forced, by forced path.

python benchmarks/clip_temp_memory.py wrn-16-4 64
"""

import json
import sys

import jax

from benchmarks.peers_run_jax import _problem
from dpscale.privacy.bookkeeping import plan_layers
from dpscale.privacy.device_tuning import NAMED_TUNING
from dpscale.privacy.ghost import make_ghost_clipped_sum_fn

loss_fn, params, batches, _ = _problem(sys.argv[1], int(sys.argv[2]), 1)
batch, mask = batches[0]
one = jax.tree_util.tree_map(lambda a: a[0], batch)
convs = [c.path for c in plan_layers(loss_fn, params, {}, one) if c.path[-1].startswith(("conv", "shortcut"))]
out = {}
for forced in ("default", "explicit", "ghost"):
    strategies = None if forced == "default" else {p: forced for p in convs}
    fn = make_ghost_clipped_sum_fn(
        loss_fn, clip_norm=1.0, example=(params, {}, batch), strategies=strategies, tuning=NAMED_TUNING["cuda"]
    )
    out[forced] = round(
        jax.jit(fn).lower(params, {}, batch, mask).compile().memory_analysis().temp_size_in_bytes / 2**20, 2
    )
print(json.dumps(out))
