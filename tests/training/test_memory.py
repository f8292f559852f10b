"""The memory estimate of an images-mode run against XLA's own analysis of the compiled clipped sum."""

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
