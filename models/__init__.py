"""Flax models that train under DP (GroupNorm/WS, normaliser-free) and a registry of them.

Convention every model follows (``ImageClassifier`` in :mod:`.classifier`, and
EfficientNet-Lite), so stages never special-case an architecture:

* Input: NHWC float images ``(B, H, W, C)``; a batch of one works, and no layer mixes
  examples, so ``jax.vmap(jax.grad(loss))`` over single examples gives true per-example
  gradients. There is no ``train`` flag: the training forward pass is ``model.apply(v, x)``.
* ``model.apply(v, x)`` -> logits ``(B, num_classes)``;
  ``model.apply(v, x, return_features=True)`` -> ``(logits, features)``.
* ``model.apply(v, x, method="features")`` -> penultimate pooled features ``(B, D)``;
  ``model.apply(v, feats, method="classify")`` -> logits. ``classify`` only reads the
  classifier's parameters, ``params[spec.head_param_key]`` (``"head"`` for the built-ins),
  so the last layer can be trained alone on cached features, or everything together.
* Trainable parameters live in the ``params`` collection. The only other collection allowed
  is frozen BatchNorm statistics (``batch_stats``, read-only); :mod:`.validation` refuses
  models whose training forward would compute or update batch statistics.

Modules: :mod:`.layers` (WS conv, scaled WS conv, GroupNorm(16), scaled activations),
:mod:`.wrn`, :mod:`.nf_resnet`, :mod:`.nfnet`, :mod:`.cnn`, :mod:`.scattering`,
:mod:`.efficientnet_lite`, :mod:`.registry` (``get_model``, ``list_models``, ``param_count``;
it lists every family from their modules, which never import it), :mod:`.catalogue` (the
listing ``dpscale models`` prints, as plain data checked against the registry) and :mod:`.validation`.
"""
