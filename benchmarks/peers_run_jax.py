"""One measurement of a JAX step (dpscale or jax-privacy) in this process; prints one JSON line.

Run by ``benchmarks/peers.py``, e.g.::

    python -m benchmarks.peers_run_jax --framework dpscale --workload cnn-small \
        --physical 64 --logical 128 --noise-multiplier 1.0

* ``dpscale`` -- what ``dpscale train`` runs: ``DpsgdStep.update`` over the micro-batches
  of one logical batch with the per-layer clipped sum of ``privacy/ghost.py`` on the conv
  models (one batched forward and backward; each layer's per-example norm from ghost norms
  or book-keeping per-example gradients, whichever is cheaper; one weighted backward), the
  closed form of ``privacy/linear.py`` on the linear ones; norms, noise once, SGD, EMA.
* ``dpscale-vmap`` -- the same step with the generic ``vmap(grad)`` clipped sum (what
  training falls back to for models book-keeping does not cover); image workloads only.
* ``dpscale-nonprivate`` -- the same ``DpsgdStep`` with ``make_unclipped_sum_fn`` (one
  batched backward per micro-batch) and noise multiplier 0.
* ``jax-privacy`` -- jax-privacy's ``clipped_grad`` on the same Flax model and loss,
  summed over micro-batches, Gaussian noise once, SGD (see ``_jax_privacy_step``).
"""

from __future__ import annotations

import time

from benchmarks.peers_measure import emit, measure, parse_runner_args, rss_now_mb

FRAMEWORKS = ("dpscale", "dpscale-vmap", "dpscale-nonprivate", "jax-privacy")


def _problem(workload: str, physical: int, micro: int):
    """(loss_fn(params, model_state, views), params, list of (batch, mask), is_linear)."""
    import jax
    import jax.numpy as jnp
    import optax

    key = jax.random.key(0)
    if workload.startswith("linear"):
        dim, classes = 1280, 10
        params = {"kernel": jax.random.normal(key, (dim, classes)) / dim**0.5, "bias": jnp.zeros(classes)}

        def loss_fn(params, model_state, views):
            del model_state
            logits = views["features"] @ params["kernel"] + params["bias"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

        batches = [
            (
                {
                    "features": jax.random.normal(jax.random.fold_in(key, i), (physical, dim)),
                    "label": jnp.arange(physical) % classes,
                },
                jnp.ones(physical),
            )
            for i in range(micro)
        ]
        return loss_fn, params, batches, True

    from dpscale.models.registry import get_model, get_spec

    spec, model = get_spec(workload), get_model(workload)
    params = jax.jit(model.init)(key, jnp.zeros((1, *spec.input_shape)))["params"]

    def loss_fn(params, model_state, views):  # views: one example's K views (K = 1 here)
        del model_state
        logits = model.apply({"params": params}, views["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, views["label"]).mean()

    batches = [
        (
            {
                "image": jax.random.normal(jax.random.fold_in(key, i), (physical, 1, *spec.input_shape)),
                "label": (jnp.arange(physical) % spec.num_classes)[:, None],
            },
            jnp.ones(physical),
        )
        for i in range(micro)
    ]
    return loss_fn, params, batches, False


def _dpscale_step(args, loss_fn, params, batches, linear: bool, extra: dict):
    import jax
    import optax

    from dpscale.privacy.ghost import make_ghost_clipped_sum_fn
    from dpscale.privacy.linear import softmax_regression_clipped_sum
    from dpscale.privacy.plan import PrivacyPlan
    from dpscale.privacy.tuning.choose import chooser, describe, describe_layers
    from dpscale.privacy.tuning.device import NAMED_TUNING
    from dpscale.training.config import TrainingConfig

    private = args.framework in ("dpscale", "dpscale-vmap")
    if private and linear:
        # As FeatureFeed does: cached features are fixed, so ||x_i||^2 is computed once per
        # dataset (here, before timing), not on every step.
        batches = [
            ({**batch, "features_sq_norm": jax.numpy.sum(batch["features"] ** 2, axis=-1)}, mask)
            for batch, mask in batches
        ]
    if args.framework == "dpscale-vmap":
        if linear:
            raise SystemExit("dpscale-vmap is for image workloads (the linear ones have a closed form)")
        clipped = None  # the DP step's default: make_clipped_sum_fn, vmap(grad)
    elif private and linear:
        clipped = softmax_regression_clipped_sum(clip_norm=1.0)
    elif private:
        if args.clip_tuning and args.clip_tuning not in NAMED_TUNING:
            raise SystemExit(f"--clip-tuning must be one of {sorted(NAMED_TUNING)}, got {args.clip_tuning!r}")
        tuning = NAMED_TUNING[args.clip_tuning] if args.clip_tuning else None
        start = time.perf_counter()
        example = (params, {}, batches[0][0])
        choose = chooser(loss_fn, example=example, tuning=tuning)
        clipped = make_ghost_clipped_sum_fn(loss_fn, clip_norm=1.0, example=example, choose=choose)
        extra["clip_paths"] = describe(clipped.layers)
        extra["clip_layers"] = describe_layers(clipped.layers)
        extra["clip_build_s"] = round(time.perf_counter() - start, 2)
    else:
        clipped = None  # a non-private plan sums plain gradients
    # The step as `dpscale train` builds it, from a plan (q = 1: only the step's shape matters here).
    plan = PrivacyPlan(
        num_examples=args.logical,
        batch_size=args.logical,
        steps=1,
        delta=1e-5,
        noise_multiplier=args.noise_multiplier if private else 0.0,
    )
    dp = plan.dp_step(
        loss_fn,
        seed=0,
        clip_norm=1.0,
        optimizer=optax.sgd(0.1),
        ema_decay=TrainingConfig.ema_decay,
        clipped_sum=lambda clip_norm: clipped,
    )
    holder = {"state": dp.init(params)}

    def step() -> None:
        holder["state"], metrics = dp.update(holder["state"], batches)
        jax.block_until_ready((holder["state"].params, metrics))

    return step


def _available_bytes() -> int:
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return int(fields["MemAvailable"].split()[0]) * 1024


def _jax_privacy_step(args, loss_fn, params, batches, linear: bool, extra: dict):
    """jax-privacy 2.x: ``clipped_grad`` (vmap of grad, clip, sum) + ``gaussian_privatizer``.

    The per-example loss is dpscale's own ``loss_fn``: image batches carry a view axis of
    size 1, which ``keep_batch_dim=False`` hands over as the example's views; feature
    batches get a leading axis of 1 from ``keep_batch_dim=True``. ``rescale_to_unit_norm``
    makes the sensitivity 1, as in dpscale, so the noise std is the noise multiplier.
    """
    import jax
    import jax_privacy
    import optax
    from jax_privacy.noise_addition import gaussian_privatizer

    key = "features" if linear else "image"
    # vmap(grad) holds one gradient per example of the micro-batch; refuse rather than let
    # the kernel's OOM killer pick a process on a shared machine.
    need = 4 * args.physical * sum(leaf.size for leaf in jax.tree.leaves(params))
    if need > 0.7 * _available_bytes():
        emit(
            {
                "status": f"skipped: per-example gradients need {need / 2**30:.1f} GiB, "
                f"{_available_bytes() / 2**30:.1f} GiB available"
            }
        )
        raise SystemExit(0)

    def fun(params, inputs, labels):
        return loss_fn(params, None, {key: inputs, "label": labels})

    clipped = jax_privacy.clipped_grad(
        fun, l2_clip_norm=1.0, rescale_to_unit_norm=True, batch_argnums=(1, 2), keep_batch_dim=linear
    )
    tx = optax.chain(gaussian_privatizer(stddev=args.noise_multiplier, prng_key=0), optax.sgd(0.1 / args.logical))

    @jax.jit
    def accumulate(params, total, inputs, labels):
        return jax.tree.map(jax.numpy.add, total, clipped(params, inputs, labels))

    @jax.jit
    def apply(params, opt_state, total):
        updates, opt_state = tx.update(total, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    holder = {"params": params, "opt": tx.init(params)}

    def step() -> None:
        total = jax.tree.map(jax.numpy.zeros_like, holder["params"])
        for batch, _ in batches:
            total = accumulate(holder["params"], total, batch[key], batch["label"])
        holder["params"], holder["opt"] = apply(holder["params"], holder["opt"], total)
        jax.block_until_ready(holder["params"])

    return step


def main() -> None:
    args = parse_runner_args(FRAMEWORKS)
    base = rss_now_mb()
    import jax

    micro = args.logical // args.physical
    loss_fn, params, batches, linear = _problem(args.workload, args.physical, micro)
    build = _jax_privacy_step if args.framework == "jax-privacy" else _dpscale_step
    extra = {
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
    }
    step = build(args, loss_fn, params, batches, linear, extra)
    if args.framework == "jax-privacy":
        import jax_privacy

        extra["jax_privacy"] = jax_privacy.__version__
    emit(measure(step, examples=args.logical, warmup=args.warmup, repeats=args.repeats, rss_base_mb=base, extra=extra))


if __name__ == "__main__":
    main()
