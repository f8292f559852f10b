"""The clipped sum of ``clipping.py`` without ``vmap(grad)``: book-keeping per-example gradients.

Why: ``vmap(value_and_grad)`` turns every convolution's kernel gradient into a grouped
convolution with one group per example, which XLA runs several times slower than the
batch gradient (on a 2-core CPU, 4.1x the non-private step on cnn-small). Book-keeping
(Bu et al. 2023, "Differentially private optimization on large model at small cost";
per-layer rules as in Goodfellow 2015 and Rochette et al. 2019) instead runs ONE forward
and ONE backward over the batch, records every layer's input ``x`` and the gradient ``g``
of the summed loss w.r.t. its output, and forms each example's parameter gradient from
``(x_i, g_i)`` with batched contractions: ``dK_i = patches(x_i)^T g_i`` for a convolution.

Surgery-free: ``flax.linen.intercept_methods`` sees every module call inside the user's
``loss_fn`` (same contract as ``make_clipped_sum_fn``); for a supported layer it records
the input and returns ``output + delta``, and ``d loss / d delta`` is ``g``. The forward
is ``vmap(loss_fn)`` over examples, exactly as the reference, so each example still sees
its K views as one batch and the 1/K of the view average is inside ``g``: the gradient is
averaged over views before clipping, as before.

What makes it safe (a missed gradient would be a privacy leak, not just an error): the
structure of ``loss_fn`` is checked on every trace, and any model it cannot prove covered
raises ``UnsupportedModelError`` (the trainer then uses ``make_clipped_sum_fn``):

* every parameter leaf belongs to a layer call with a rule (``privacy.layer_rules``: WS and
  plain convolutions, EfficientNet-Lite's depthwise convolution, dense layers, GroupNorm and
  frozen BatchNorm; exact types) and *is* the array that layer reads (object identity); the
  only other variables a call may read are its rule's (frozen statistics), which the rule gets
  as recorded in the forward;
* the loss depends on the parameters through those calls only: with the layers fed
  separate copies of their parameters, no path in the jaxpr leads from the parameters to
  the loss (a conservative data-flow check, e.g. a weight penalty in the loss fails it, and
  so do statistics computed from the parameters).

Norms, clip weights, the NaN guard and counts are ``clipping.clipped_sum_from_gradients``,
unchanged, so the result has the same meaning and sensitivity 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.extend import core as jex_core

from dpscale.errors import InvalidConfigError
from dpscale.privacy.checks import check_clip_norm
from dpscale.privacy.clipping import ClippedSum, ClippedSumFn, LossFn, clipped_sum_from_gradients
from dpscale.privacy.layer_rules import RULES, Rule
from dpscale.privacy.rounding import FORMATS, ClipPrecision, Format

PyTree = Any
Path = tuple[str, ...]


class UnsupportedModelError(InvalidConfigError):
    """The model has a parameter or a use of one that no book-keeping rule covers."""


def _is_layer_call(context: Any) -> bool:
    return context.method_name == "__call__" and type(context.module) in RULES


@dataclasses.dataclass(frozen=True)
class LayerCall:
    path: Path
    module: nn.Module  # unbound clone with the same attributes
    out: jax.ShapeDtypeStruct  # one example's output ([K, ...])


def key_path(path: tuple[Any, ...]) -> Path:
    keys = []
    for entry in path:
        if not isinstance(entry, jax.tree_util.DictKey) or not isinstance(entry.key, str):
            raise UnsupportedModelError(f"book-keeping needs params as nested dicts, got key {entry!r}")
        keys.append(entry.key)
    return tuple(keys)


def _param_leaves(params: PyTree) -> dict[Path, Any]:
    return {key_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _output_depends_on(jaxpr: jex_core.Jaxpr, tainted_inputs: list[bool]) -> bool:
    """Whether any output can depend on a tainted input (over-approximated: safe to refuse)."""
    tainted = {v for v, flag in zip(jaxpr.invars, tainted_inputs) if flag}

    def hit(atom: Any) -> bool:
        return isinstance(atom, jex_core.Var) and atom in tainted

    for eqn in jaxpr.eqns:
        if any(hit(v) for v in eqn.invars):
            tainted.update(eqn.outvars)
    return any(hit(v) for v in jaxpr.outvars)


def plan_batch_layers(loss_fn: LossFn, params: PyTree, model_state: PyTree, batch: PyTree) -> tuple[LayerCall, ...]:
    """``plan_layers`` on one example of ``batch`` (leaves ``[b, ...]``: arrays or ``ShapeDtypeStruct``)."""
    one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
    return plan_layers(loss_fn, params, model_state, one)


def plan_layers(loss_fn: LossFn, params: PyTree, model_state: PyTree, views: PyTree) -> tuple[LayerCall, ...]:
    """The supported layer calls of ``loss_fn`` on one example's views, or UnsupportedModelError.

    Arguments may be arrays, tracers or ``ShapeDtypeStruct``; only shapes are used.
    """
    params, model_state, views = _abstract(params), _abstract(model_state), _abstract(views)
    leaves = _param_leaves(params)
    calls: list[LayerCall] = []
    problems: list[str] = []

    def record(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        if not _is_layer_call(context):
            return next_fun(*args, **kwargs)
        module, path = context.module, tuple(context.module.path)
        problem = _call_problem(module, args, kwargs, traced_leaves)
        if problem is not None:
            problems.append(f"{'/'.join(path)}: {problem}")
        try:
            out = next_fun(*args, **kwargs)
        except Exception:  # e.g. BatchNorm on batch statistics that may not be updated
            if problem is None:
                raise
            raise UnsupportedModelError("book-keeping cannot cover " + "; ".join(problems)) from None
        if jnp.result_type(out) != jnp.float32:
            problems.append(f"{'/'.join(path)}: its output is {jnp.result_type(out)}, not float32")
        calls.append(LayerCall(path, module.clone(parent=None), jax.ShapeDtypeStruct(out.shape, out.dtype)))
        return out

    traced_leaves: dict[Path, Any] = {}

    def recording_loss(p: PyTree, s: PyTree, v: PyTree) -> jax.Array:
        traced_leaves.update(_param_leaves(p))
        with nn.intercept_methods(record):
            return loss_fn(p, s, v)

    out = jax.eval_shape(recording_loss, params, model_state, views)
    if out.shape != ():
        raise UnsupportedModelError(f"loss_fn must return a scalar, got shape {out.shape}")
    if problems:
        raise UnsupportedModelError("book-keeping cannot cover " + "; ".join(problems))
    covered = {c.path + (name,) for c in calls for name in _param_leaves_of_call(c, leaves)}
    missing = sorted("/".join(p) for p in set(leaves) - covered)
    if missing:
        raise UnsupportedModelError(
            f"book-keeping has no rule for parameters {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )

    # Feed every layer call a separate copy of its parameters: the loss must then not
    # depend on the parameters given to loss_fn at all.
    copies = [{name: leaves[c.path + (name,)] for name in _param_leaves_of_call(c, leaves)} for c in calls]

    def substituted_loss(p: PyTree, layer_params: list[PyTree], s: PyTree, v: PyTree) -> jax.Array:
        counter = iter(range(len(calls)))
        inside = []  # non-empty while a copy runs: its own call is not substituted again

        def substitute(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
            if inside or not _is_layer_call(context):
                return next_fun(*args, **kwargs)
            index = next(counter)
            inside.append(index)
            try:
                variables = {"params": layer_params[index], **_state_of(context.module)}
                return calls[index].module.apply(variables, *args)
            finally:
                inside.pop()

        with nn.intercept_methods(substitute):
            return loss_fn(p, s, v)

    closed = jax.make_jaxpr(substituted_loss)(params, copies, model_state, views)
    flags = [True] * len(leaves) + [False] * (len(closed.jaxpr.invars) - len(leaves))
    if _output_depends_on(closed.jaxpr, flags):
        raise UnsupportedModelError(
            "the loss uses parameters outside the supported layer calls (e.g. a penalty on the weights)"
        )
    return tuple(calls)


def _call_problem(module: nn.Module, args: tuple, kwargs: dict, traced_leaves: dict[Path, Any]) -> str | None:
    """Why a call of a layer type with a rule is not covered by it, or None."""
    rule: Rule = RULES[type(module)]
    own = module.variables.get("params", {})
    state = _state_of(module)
    name = type(module).__name__
    if set(state) - rule.state or kwargs or len(args) != 1:
        return f"a {name} call with extra variables or arguments"
    if set(own) - rule.param_names:
        return f"parameters {sorted(set(own) - rule.param_names)} have no rule"
    if any(own[n] is not traced_leaves.get(tuple(module.path) + (n,)) for n in own):
        return "its parameters are not the leaves passed to loss_fn"
    if (
        jnp.result_type(args[0]) != jnp.float32
        or any(leaf.dtype != jnp.float32 for leaf in jax.tree_util.tree_leaves((own, state)))
        or jnp.dtype(getattr(module, "dtype", None) or jnp.float32) != jnp.float32
    ):
        return "not float32 (its input, parameters, state or computation)"
    return rule.problem(module, args[0])


def _state_of(module: nn.Module) -> dict[str, PyTree]:
    """The variables a layer call reads besides its parameters (frozen statistics)."""
    return {name: tree for name, tree in module.variables.items() if name != "params"}


def _param_leaves_of_call(call: LayerCall, leaves: dict[Path, Any]) -> list[str]:
    return [path[-1] for path in leaves if path[:-1] == call.path]


@dataclasses.dataclass(frozen=True)
class Tape:
    """What one batched forward and backward saw at every supported layer call, in call order."""

    losses: jax.Array  # [b], each example's (view-averaged) loss
    inputs: list[jax.Array]  # the call's input, [b, K, ...]
    outputs: list[jax.Array]  # the call's output, [b, K, ...]
    out_grads: list[jax.Array]  # d (sum of the losses) / d output, [b, K, ...]
    states: list[PyTree]  # the call's other variables (frozen statistics), {collection: tree}, leaves [b, ...]


def record_layers(
    loss_fn: LossFn, calls: tuple[LayerCall, ...], params: PyTree, model_state: PyTree, batch: PyTree
) -> Tape:
    """One forward (``vmap`` over examples, as the reference) and one backward to every layer's output.

    Each supported call returns ``output + delta``; ``d loss / d delta`` is its output gradient.
    """
    size = jax.tree_util.tree_leaves(batch)[0].shape[0]
    deltas = [jnp.zeros((size,) + c.out.shape, c.out.dtype) for c in calls]

    def one(example_deltas: list[jax.Array], views: PyTree) -> tuple[jax.Array, tuple[list, list, list]]:
        inputs: list[jax.Array] = []
        outputs: list[jax.Array] = []
        states: list[PyTree] = []

        def perturb(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
            if not _is_layer_call(context):
                return next_fun(*args, **kwargs)
            index = len(inputs)
            if index >= len(calls) or tuple(context.module.path) != calls[index].path:
                raise UnsupportedModelError("the model's layer calls changed between traces")
            inputs.append(args[0])
            states.append(_state_of(context.module))
            out = next_fun(*args, **kwargs)
            outputs.append(out)
            return out + example_deltas[index]

        with nn.intercept_methods(perturb):
            loss = loss_fn(params, model_state, views)
        if len(inputs) != len(calls):
            raise UnsupportedModelError("the model's layer calls changed between traces")
        return loss, (inputs, outputs, states)

    def summed(ds: list[jax.Array]) -> tuple[jax.Array, tuple[jax.Array, tuple[list, list, list]]]:
        losses, recorded = jax.vmap(one)(ds, batch)
        return jnp.sum(losses), (losses, recorded)

    (_, (losses, (inputs, outputs, states))), out_grads = jax.value_and_grad(summed, has_aux=True)(deltas)
    return Tape(losses=losses, inputs=inputs, outputs=outputs, out_grads=out_grads, states=states)


def layer_params(call: LayerCall, params: PyTree) -> dict[str, jax.Array]:
    """The parameters ``call`` reads, by name (``kernel``, ``bias``, ``scale``, ...)."""
    leaves = _param_leaves(params)
    return {name: leaves[call.path + (name,)] for name in _param_leaves_of_call(call, leaves)}


def per_example_layer_gradients(
    call: LayerCall,
    params: PyTree,
    x: jax.Array,
    g: jax.Array,
    state: PyTree,
    *,
    precision: Format = FORMATS["highest"],
) -> dict[str, jax.Array]:
    """Each example's gradient of the parameters of ``call`` from its recorded input, output gradient
    and other variables (``Tape``)."""
    return RULES[type(call.module)].grads(call.module, layer_params(call, params), state, x, g, precision)


def per_example_gradients_bk(
    loss_fn: LossFn,
    params: PyTree,
    model_state: PyTree,
    batch: PyTree,
    *,
    precision: Format = FORMATS["highest"],
) -> tuple[jax.Array, PyTree]:
    """Like ``clipping.per_example_gradients`` (losses ``[b]``, leaves ``[b, *shape]``), by book-keeping;
    the convolutions' per-example products run at ``precision``."""
    calls = plan_batch_layers(loss_fn, params, model_state, batch)
    tape = record_layers(loss_fn, calls, params, model_state, batch)
    grads: dict[Path, jax.Array] = {}
    for call, x, g, state in zip(calls, tape.inputs, tape.out_grads, tape.states):
        for name, grad in per_example_layer_gradients(call, params, x, g, state, precision=precision).items():
            key = call.path + (name,)
            grads[key] = grad if key not in grads else grads[key] + grad  # a layer called twice
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    return tape.losses, jax.tree_util.tree_unflatten(treedef, [grads[key_path(p)] for p, _ in flat])


def make_bookkeeping_clipped_sum_fn(
    loss_fn: LossFn,
    *,
    clip_norm: float,
    example: tuple[PyTree, PyTree, PyTree] | None = None,
    precision: ClipPrecision | None = None,
) -> ClippedSumFn:
    """Drop-in for ``make_clipped_sum_fn`` on supported models.

    ``example = (params, model_state, batch)`` (arrays or ``ShapeDtypeStruct``; batch leaves
    ``[b, K, ...]``) checks support now, raising ``UnsupportedModelError``; without it the
    check runs on the first trace. ``precision.norms`` is that of the convolutions' per-example
    products (``privacy.rounding``; default: float32): the gradients are held, so the
    clip weights bound what is summed at any precision.
    """
    check_clip_norm(clip_norm)
    fmt = (precision or ClipPrecision()).norm_format
    if example is not None:
        plan_batch_layers(loss_fn, *example)

    def clipped_sum(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
        losses, grads = per_example_gradients_bk(loss_fn, params, model_state, batch, precision=fmt)
        return clipped_sum_from_gradients(grads, mask, clip_norm=clip_norm, losses=losses)

    return ClippedSumFn(clipped_sum, sensitivity=1.0)
