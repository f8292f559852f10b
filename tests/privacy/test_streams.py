"""Independent models: no key of any stream coincides with another, across 10^5 models."""

import jax
import numpy as np

from dpscale.privacy.noise import step_key
from dpscale.privacy.streams import Stream, model_keys, stream_key

MODELS, STEPS, SEED = 100_000, 2, 2**62 + 12345


def _words(keys: jax.Array) -> np.ndarray:
    """Each key's 64 bits as one integer."""
    data = np.asarray(jax.random.key_data(keys), np.uint64).reshape(-1, 2)
    return (data[:, 0] << np.uint64(32)) | data[:, 1]


def test_no_two_keys_coincide_across_models_streams_and_steps():
    keys = jax.jit(jax.vmap(lambda m: model_keys(SEED, m)))(np.arange(MODELS, dtype=np.uint32))
    per_step = jax.jit(jax.vmap(lambda k, n: [(jax.random.fold_in(k, t), step_key(n, t)) for t in range(STEPS)]))(
        keys.sampling, keys.noise
    )
    seed_level = [stream_key(SEED, stream) for stream in Stream]  # shared init, audit data, base keys
    everything = np.concatenate(
        [_words(keys.init), _words(keys.sampling), _words(keys.noise)]
        + [_words(k) for pair in per_step for k in pair]
        + [_words(k[None]) for k in seed_level]
    )
    assert len(everything) == MODELS * (3 + 2 * STEPS) + len(Stream)
    assert len(np.unique(everything)) == len(everything)


def test_model_keys_are_the_stream_keys_the_trainers_fold():
    keys = model_keys(SEED, 7)
    for got, stream in zip(keys, (Stream.INIT, Stream.SAMPLING, Stream.NOISE)):
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(stream_key(SEED, stream, 7)))
