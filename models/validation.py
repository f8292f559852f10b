"""Refuse models whose training-mode forward pass mixes examples, before DP training starts.

DP-SGD's guarantee rests on each example's gradient depending on that example alone.
BatchNorm with batch statistics breaks this: the normalisation of example ``i`` depends on
every other example in the batch, so clipping per-example gradients no longer bounds one
example's influence (and under ``vmap`` over single examples it silently degenerates).

What is allowed: GroupNorm / LayerNorm / weight standardisation (per-example statistics),
and **frozen-statistics BatchNorm** (``use_running_average=True``), as used to fine-tune
EfficientNet-Lite: its mean/variance are constants from pre-training, its scale and bias
stay trainable, and nothing is computed across the batch.

Two independent checks run on abstract values (``jax.eval_shape``, nothing is allocated):

1. every ``nn.BatchNorm`` call in the training forward pass is intercepted and refused if
   it would use batch statistics, naming the layer's path;
2. the training forward pass is run with all variable collections immutable, so any layer
   that tries to update state (running statistics of a custom norm layer, ...) is refused
   with the variable it tried to write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import linen as nn

from dpscale.errors import InvalidConfigError


def _layer_path(module: nn.Module) -> str:
    path = "/".join(str(part) for part in (module.path or ()))
    return f"{type(module).__name__} at '{path or '<root>'}'"


def _uses_batch_statistics(module: nn.BatchNorm, kwargs: Mapping[str, Any]) -> bool:
    call_value = kwargs.get("use_running_average")
    if call_value is not None:
        return not bool(call_value)
    return module.use_running_average is not True


def validate_dp_model(
    model: nn.Module,
    input_shape: tuple[int, ...],
    *,
    apply_kwargs: Mapping[str, Any] | None = None,
    variables: Any = None,
) -> None:
    """Raise :class:`InvalidConfigError` if ``model`` mixes examples in its training forward.

    ``input_shape`` is one example's shape (e.g. ``(32, 32, 3)``); ``apply_kwargs`` are the
    keyword arguments the training step passes to ``model.apply`` (e.g. ``{"train": True}``).
    ``variables`` may be real or abstract; by default they come from ``eval_shape(init)``.
    """
    kwargs = dict(apply_kwargs or {})
    x = jax.ShapeDtypeStruct((2, *input_shape), jnp.float32)
    if variables is None:
        variables = jax.eval_shape(lambda key, x: model.init(key, x, **kwargs), jax.random.key(0), x)
    offenders: list[str] = []

    def interceptor(next_fun, args, call_kwargs, context):
        module = context.module
        if isinstance(module, nn.BatchNorm) and context.method_name == "__call__":
            if _uses_batch_statistics(module, call_kwargs):
                offenders.append(_layer_path(module))
        return next_fun(*args, **call_kwargs)

    def forward(variables, x):
        with nn.intercept_methods(interceptor):
            return model.apply(variables, x, mutable=False, **kwargs)

    try:
        jax.eval_shape(forward, variables, x)
    except flax.errors.ModifyScopeVariableError as exc:
        if offenders:
            raise _batchnorm_error(offenders) from exc
        raise InvalidConfigError(
            "model updates state in its training forward pass, which is not allowed under DP "
            f"(a layer computing statistics across the batch?): {exc}"
        ) from exc
    if offenders:
        raise _batchnorm_error(offenders)


def _batchnorm_error(offenders: list[str]) -> InvalidConfigError:
    unique = list(dict.fromkeys(offenders))
    return InvalidConfigError(
        "BatchNorm with batch statistics mixes examples and breaks per-example DP sensitivity: "
        f"{', '.join(unique)}. Use GroupNorm, or freeze the statistics "
        "(nn.BatchNorm(use_running_average=True))."
    )
