"""Augmentation multiplicity: K random views of every example, made on device.

Each view is a random crop of the image reflect-padded by ``pad`` pixels, flipped
horizontally with probability 1/2 (De et al. 2022). The K views of one example
feed one per-example gradient (averaged before clipping), so K costs compute but
no privacy. Views are drawn from their own key stream, separate from the DP noise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _one_view(key: jax.Array, image: jax.Array, *, pad: int, flip: bool) -> jax.Array:
    height, width = image.shape[0], image.shape[1]
    crop_key, flip_key = jax.random.split(key)
    if pad > 0:
        padded = jnp.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode="reflect")
        top, left = jax.random.randint(crop_key, (2,), 0, 2 * pad + 1)
        image = jax.lax.dynamic_slice(padded, (top, left, 0), (height, width, image.shape[2]))
    if flip:
        image = jnp.where(jax.random.bernoulli(flip_key), image[:, ::-1, :], image)
    return image


@functools.partial(jax.jit, static_argnames=("views", "pad", "flip"))
def augment_views(key: jax.Array, images: jax.Array, *, views: int, pad: int = 4, flip: bool = True) -> jax.Array:
    """``[b, H, W, C] -> [b, views, H, W, C]`` random crop-and-flip views.

    With ``pad=0`` and ``flip=False`` every view is the image itself.
    """
    batch = images.shape[0]
    keys = jax.random.split(key, batch * views).reshape(batch, views)
    per_view = functools.partial(_one_view, pad=pad, flip=flip)
    return jax.vmap(lambda ks, im: jax.vmap(lambda k: per_view(k, im))(ks))(keys, images)
