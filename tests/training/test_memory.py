"""The memory estimate of an images-mode run against XLA's own analysis of the compiled clipped sum."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from dpscale.errors import InvalidConfigError
from dpscale.models import registry
from dpscale.privacy.clipping import make_clipped_sum_fn
from dpscale.training import memory


def test_the_estimate_is_close_to_what_xla_allocates_for_the_clipped_sum():
    model = registry.get_model("cnn-small", num_classes=10)
    shape, examples = (28, 28, 1), 32
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *shape)))["params"]

    def loss(p, state, views):
        logits = model.apply({"params": p}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    one = {"image": jax.ShapeDtypeStruct((1, *shape), jnp.float32), "label": jax.ShapeDtypeStruct((1,), jnp.int32)}
    found = memory.estimate(loss, params, {}, one, examples=examples, momentum=False)
    batch = {
        "image": jax.ShapeDtypeStruct((examples, 1, *shape), jnp.float32),
        "label": jax.ShapeDtypeStruct((examples, 1), jnp.int32),
    }
    compiled = (
        jax.jit(make_clipped_sum_fn(loss, clip_norm=1.0))
        .lower(params, {}, batch, jax.ShapeDtypeStruct((examples,), jnp.float32))
        .compile()
    )
    allocated = compiled.memory_analysis().temp_size_in_bytes
    assert 0.7 * allocated <= examples * found.per_example_bytes <= 1.5 * allocated


def test_a_run_that_cannot_fit_is_refused_with_the_micro_batch_that_would():
    found = memory.MemoryEstimate(state_bytes=4 * 2**30, per_example_bytes=2**30, examples=64)
    with pytest.raises(InvalidConfigError, match="--microbatch-size 12 or less"):
        memory.check_fits(found, model="big", microbatch_size=64, devices=1, available=(16 * 2**30, "RAM"))
    memory.check_fits(found, model="big", microbatch_size=64, devices=1, available=(69 * 2**30, "RAM"))
    with pytest.raises(InvalidConfigError, match="smaller --model"):
        memory.check_fits(found, model="big", microbatch_size=64, devices=1, available=(4 * 2**30, "RAM"))


def test_the_clip_paths_working_set_is_added_per_example_as_each_path_is_chunked():
    from dpscale.privacy.ghost import LayerChoice, LayerShape
    from dpscale.privacy.layer_bounds import chunk_work
    from dpscale.privacy.tuning.cost import working_set

    found = memory.MemoryEstimate(state_bytes=0, per_example_bytes=1000, examples=64)
    whole_batch = 2**62  # an accelerator's chunk_bytes: every example at once
    ghost = LayerChoice(("conv",), "WSConv", "ghost", positions=4096, fan_in=576, fan_out=64, chunk_bytes=whole_batch)
    booked = LayerChoice(("norm",), "GroupNorm", "book-keeping")
    in_flight = working_set("ghost", LayerShape(64, 4096, 576, 64))[1]  # bytes an example
    whole = memory.with_clip_paths(found, [booked, ghost], examples=64)
    assert whole.per_example_bytes == 1000 + in_flight
    work = chunk_work("ghost", 4096, 576, 64)
    by_guard = memory.with_clip_paths(
        found, [booked, dataclasses.replace(ghost, chunk=8, chunk_bytes=8 * work)], examples=64
    )
    assert by_guard.per_example_bytes == 1000 + in_flight * 8 // 64  # the guard's chunks of 8
    on_cpu = memory.with_clip_paths(found, [dataclasses.replace(ghost, chunk_bytes=1)], examples=64)
    assert on_cpu.per_example_bytes == 1000 + -(-in_flight // 64)  # one example at a time
    assert memory.with_clip_paths(found, [booked], examples=64) == found
    # The chunk is the one layer_bounds.chunked runs: a divisor of the micro-batch (room for 5 of
    # 64 runs 4), and an explicit path's held loop has at least two chunks (32 of 64 at once).
    five = memory.with_clip_paths(found, [dataclasses.replace(ghost, chunk_bytes=5 * work)], examples=64)
    assert five.per_example_bytes == 1000 + -(-in_flight * 4 // 64)
    explicit = dataclasses.replace(ghost, strategy="explicit")
    product = working_set("explicit", LayerShape(64, 4096, 576, 64))[1]
    halves = memory.with_clip_paths(found, [explicit], examples=64)
    assert halves.per_example_bytes == 1000 + product * 32 // 64
    # A run the estimate alone lets through is refused once the paths' working set is known.
    memory.check_fits(found, model="m", microbatch_size=64, devices=1, available=(2 * 64 * 1000, "RAM"))
    with pytest.raises(InvalidConfigError, match="--microbatch-size"):
        memory.check_fits(whole, model="m", microbatch_size=64, devices=1, available=(2 * 64 * 1000, "RAM"))
