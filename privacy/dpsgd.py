"""The DP-SGD update: accumulate clipped sums, add noise once, apply any optax optimiser.

For a logical batch of expected size B cut into micro-batches,

    g = ( sum_micro S_micro  +  sigma * Delta * xi ) / B,     xi ~ N(0, I)

where each S_micro is a ``ClippedSum`` (sum of clip_C(g_i)/C, sensitivity Delta=1).
The noise is added exactly once per optimiser update, whatever the number of
micro-batches (never per micro-batch), and B is the *expected* batch size of
Poisson sampling, not the realised one. ``g`` then goes
through any optax optimiser (plain SGD by default, no weight decay), and the EMA
of the parameters is updated on real optimiser updates only.

Data parallelism: with a ``Mesh``, micro-batches are sharded over its ``data``
axis and parameters replicated; each device clips its own examples (``shard_map``)
and the clipped sums are all-reduced, so every device holds the same sum, draws the same noise from the same key, and the update does
not depend on the number of devices. The mesh may span several processes
(``dpscale.distributed``): the key and the state are then replicated on every
device of every process, and the micro-batches are global arrays.

A run never builds this step itself: ``privacy.plan.PrivacyPlan.dp_step`` does, from the
calibrated plan, so the noise, the batch size it is divided by and the accountant's
event cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpscale.distributed import put_replicated
from dpscale.errors import InvalidConfigError
from dpscale.privacy.checks import check_ema_decay, check_noise_multiplier, check_positive
from dpscale.privacy.clipping import ClippedSum, ClippedSumFn
from dpscale.privacy.ema import ema_update
from dpscale.privacy.example_sum import StepSums, room, step_sums
from dpscale.privacy.noise import add_gaussian_noise, step_key
from dpscale.privacy.streams import Stream, stream_key

PyTree = Any
DATA_AXIS = "data"


@struct.dataclass
class TrainState:
    """Everything that changes during training. ``step`` counts optimiser updates."""

    params: PyTree
    opt_state: PyTree
    ema_params: PyTree
    model_state: PyTree  # frozen non-trainable state (e.g. BatchNorm statistics), may be {}
    step: jax.Array


def _zeros_like_clipped_sum(params: PyTree, sensitivity: float) -> ClippedSum:
    """An accumulator holding the sum over no examples.

    It carries the sensitivity the micro-batch sums will have (a valid upper
    bound), so every accumulate call sees the same static structure and compiles
    once.
    """
    zero_int = jnp.zeros((), jnp.int32)
    zero = jnp.zeros((), jnp.float32)
    return ClippedSum(
        value=jax.tree_util.tree_map(jnp.zeros_like, params),
        value_error=jax.tree_util.tree_map(jnp.zeros_like, params),
        num_examples=zero_int,
        num_clipped=zero_int,
        num_nonfinite=zero_int,
        sum_of_norms=zero,
        sum_of_losses=zero,
        sensitivity=sensitivity,
    )


class DpsgdStep:
    """Ties clipping, accumulation, noise and the optimiser into one update.

    Use ``init`` once, then per optimiser step either ``update(state, microbatches)``
    or, for custom loops, ``zero_sum`` / ``accumulate`` (per micro-batch) / ``apply``.
    ``clipped_sum_fn`` forms each micro-batch's clipped sum and states its sensitivity
    (``privacy.clipping.ClippedSumFn``). The noise of step t is drawn from ``Stream.NOISE``
    of ``seed`` (which must come from ``privacy.seeds.resolve_seed``) at t.
    ``noise_multiplier`` sigma is relative to that sensitivity, ``expected_batch_size`` is
    the B the noisy sum is divided by (the expected size under Poisson sampling),
    ``ema_decay`` the EMA's decay after its warm-up, and ``capacity`` the most real examples
    a step holds: every clip leaves room for the float32 sum of that many
    (``privacy.example_sum.room``), so the step's whole sum moves by at most its sensitivity.
    """

    def __init__(
        self,
        clipped_sum_fn: ClippedSumFn,
        *,
        noise_multiplier: float,
        expected_batch_size: float,
        seed: int,
        optimizer: optax.GradientTransformation,
        ema_decay: float,
        capacity: int,
        mesh: Mesh | None = None,
    ) -> None:
        if not isinstance(clipped_sum_fn, ClippedSumFn):
            raise TypeError(
                f"clipped_sum_fn must be a ClippedSumFn (a function with its stated sensitivity), "
                f"got {type(clipped_sum_fn).__name__}"
            )
        check_noise_multiplier(noise_multiplier, zero_allowed=True)
        check_positive(expected_batch_size, "expected batch size")
        check_ema_decay(ema_decay)
        check_positive(capacity, "capacity")
        self.capacity = int(capacity)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.ema_decay = float(ema_decay)
        self.optimizer = optimizer
        self.mesh = mesh
        # Replicated like the state: with several processes every device holds the same key.
        self.noise_key = stream_key(seed, Stream.NOISE)
        self._noise_base_key = self.replicate(self.noise_key)
        self.clipped_sum_fn = clipped_sum_fn
        self._sensitivity = clipped_sum_fn.sensitivity
        if self.noise_multiplier > 0 and not math.isfinite(self._sensitivity):
            raise InvalidConfigError("noise cannot be calibrated to a sum of unbounded sensitivity")
        replicated = self._sharding(PartitionSpec())
        batch_sharded = self._sharding(PartitionSpec(DATA_AXIS))
        self._accumulate = jax.jit(
            self.accumulate_traceable,
            donate_argnums=(1,),
            in_shardings=(None if mesh is None else (replicated, replicated, batch_sharded, batch_sharded, replicated)),
            out_shardings=replicated,
        )
        self._apply = jax.jit(self.apply_pure, donate_argnums=(0,), out_shardings=replicated)
        self._privatize = jax.jit(self._privatize_impl, out_shardings=replicated)
        self._zero_sum = jax.jit(_zeros_like_clipped_sum, static_argnums=(1,), out_shardings=replicated)

    # -- public API -------------------------------------------------------------------

    @property
    def noise_std(self) -> float:
        """Std of the noise on the *mean* gradient: sigma / B (sensitivity 1 after /C)."""
        return self.noise_multiplier / self.expected_batch_size

    @property
    def num_devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[DATA_AXIS]

    def replicate(self, tree: PyTree) -> PyTree:
        """Place ``tree`` on the devices the way ``init`` does (e.g. after a restore)."""
        sharding = self._sharding(PartitionSpec())
        return tree if sharding is None else put_replicated(tree, sharding)

    def init(self, params: PyTree, model_state: PyTree | None = None) -> TrainState:
        """A fresh state; ``params`` are copied, since ``apply`` donates the state's buffers."""
        state = TrainState(
            params=jax.tree_util.tree_map(jnp.array, params),
            opt_state=self.optimizer.init(params),
            ema_params=jax.tree_util.tree_map(jnp.array, params),
            model_state={} if model_state is None else model_state,
            step=jnp.zeros((), jnp.int32),
        )
        return self.replicate(state)

    def zero_sum(self, state: TrainState) -> ClippedSum:
        return self._zero_sum(state.params, self._sensitivity)

    def accumulate(self, state: TrainState, total: ClippedSum, batch: PyTree, mask: jax.Array) -> ClippedSum:
        """Add one micro-batch's clipped sum to ``total`` (``total`` is donated)."""
        leading = jax.tree_util.tree_leaves(batch)[0].shape[0]
        if leading % self.num_devices:
            raise InvalidConfigError(f"micro-batch size {leading} is not divisible by the {self.num_devices} devices")
        return self._accumulate(state.params, total, batch, mask, state.model_state)

    def privatized_gradient(self, total: ClippedSum, step: int | jax.Array) -> PyTree:
        """The noisy mean gradient ``(S + sigma*Delta*xi) / B`` that ``apply`` would use."""
        return self._privatize(total, jnp.asarray(step, jnp.int32), self._noise_base_key)

    def apply(self, state: TrainState, total: ClippedSum) -> tuple[TrainState, dict[str, jax.Array]]:
        """Noise, optimiser update and EMA for one logical batch (``state`` is donated)."""
        return self._apply(state, total, self._noise_base_key)

    def update(
        self, state: TrainState, microbatches: Iterable[tuple[PyTree, jax.Array]]
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimiser step over all micro-batches of one logical batch."""
        total = self.zero_sum(state)
        for batch, mask in microbatches:
            total = self.accumulate(state, total, batch, mask)
        return self.apply(state, total)

    # -- pure bodies: what the jitted methods run -------------------------------------
    # Side-effect free with explicit keys, so callers can ``vmap`` them over many
    # independent models (the privacy audit trains thousands this way).

    def accumulate_pure(
        self, params: PyTree, total: ClippedSum, batch: PyTree, mask: jax.Array, model_state: PyTree
    ) -> ClippedSum:
        """``total`` plus the clipped sum of one micro-batch."""
        with step_sums(self._sums(mask.shape[0])):
            return total.plus(self.clipped_sum_fn(params, model_state, batch, mask))

    def _sums(self, slots: int) -> StepSums:
        """How this step adds up the clipped sums of micro-batches of ``slots`` slots."""
        return StepSums(slots=slots, devices=self.num_devices, step_slots=self.capacity)

    def room(self, slots: int) -> float:
        """The factor ``c`` every clipped contribution carries in this step, at micro-batches of ``slots``
        slots: the room for the float32 sum of the whole step (``privacy.example_sum.room``)."""
        with step_sums(self._sums(slots)):
            return float(room(slots))

    @property
    def accumulate_traceable(self) -> Callable[..., ClippedSum]:
        """The pure body ``accumulate`` jits: ``accumulate_pure`` on one device, else the ``shard_map``ped one.

        For callers that ``vmap`` whole runs (the white-box audit) on this step's mesh.
        """
        return self.accumulate_pure if self.mesh is None else self._accumulate_sharded

    def _accumulate_sharded(
        self, params: PyTree, total: ClippedSum, batch: PyTree, mask: jax.Array, model_state: PyTree
    ) -> ClippedSum:
        """``accumulate_pure`` over a mesh: each device clips its own examples, then one ``psum``.

        Left to the SPMD partitioner, per-example gradients of convolutions get resharded
        with all-to-alls (the batch is folded into a feature axis), which moves per-example
        tensors between devices and, on XLA:CPU, aborted long runs with a collective
        rendezvous timeout. Under ``shard_map`` only the parameter-sized sums cross devices.
        """

        sums = self._sums(mask.shape[0])  # the whole micro-batch's room: the same on any number of devices

        def local(params: PyTree, model_state: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
            with step_sums(sums):
                return jax.lax.psum(self.clipped_sum_fn(params, model_state, batch, mask), DATA_AXIS)

        # check_vma=False: with it, differentiating w.r.t. the replicated parameters inside
        # would psum every per-example gradient over devices (mixing examples) before clipping.
        clipped = jax.shard_map(
            local,
            mesh=self.mesh,
            out_specs=PartitionSpec(),
            check_vma=False,
            in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(DATA_AXIS), PartitionSpec(DATA_AXIS)),
        )(params, model_state, batch, mask)
        return total.plus(clipped)

    def _privatize_impl(self, total: ClippedSum, step: jax.Array, base_key: jax.Array) -> PyTree:
        if self.noise_multiplier == 0:  # no noise: a non-private baseline
            noisy_sum = total.summed()
        elif math.isfinite(total.sensitivity):
            key = step_key(base_key, step)
            std = self.noise_multiplier * total.sensitivity
            noisy_sum = add_gaussian_noise(total.summed(), key, std=std)
        else:
            raise InvalidConfigError("noise cannot be calibrated to a sum of unbounded sensitivity")
        return jax.tree_util.tree_map(lambda x: x / self.expected_batch_size, noisy_sum)

    def apply_pure(
        self, state: TrainState, total: ClippedSum, base_key: jax.Array
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """Noise (key ``step_key(base_key, state.step)``), optimiser update and EMA."""
        grad = self._privatize_impl(total, state.step, base_key)
        updates, opt_state = self.optimizer.update(grad, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ema = ema_update(state.ema_params, params, step=state.step, decay=self.ema_decay)
        real = jnp.maximum(total.num_examples, 1)
        metrics = {
            "batch_size": total.num_examples,
            "loss": total.sum_of_losses / real,
            "clipped_fraction": total.num_clipped / real,
            "mean_grad_norm": total.sum_of_norms / real,
            "nonfinite": total.num_nonfinite,
            "update_norm": optax.global_norm(grad),
        }
        new_state = state.replace(params=params, opt_state=opt_state, ema_params=ema, step=state.step + 1)
        return new_state, metrics

    def _sharding(self, spec: PartitionSpec) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, spec)


def data_mesh(devices: Iterable[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over ``devices`` (all local devices by default) with axis ``data``."""
    devs = list(jax.devices() if devices is None else devices)
    return Mesh(devs, (DATA_AXIS,))
