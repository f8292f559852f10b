"""How the per-layer clipped sum is tuned for the device it runs on: precision, chunking, how paths are
chosen.

Why: the fastest way to clip differs between devices. On a 2-core CPU per-example work runs best in
cache-sized chunks of examples (``lax.map``) at full float32, and a shape rule measured there
(``ghost.GHOST_RATIO``) picks each layer's path. On a GPU a chunked loop is a sequential loop of
small kernels, full float32 contractions skip the tensor cores (the non-private step's convolutions
use them), and a rule measured on a CPU says nothing about the cost of a Gram matrix against a held
gradient there. So a GPU or TPU runs each micro-batch's per-example work at once, and *measures*
each distinct layer shape's candidate paths (and precisions, where a lower one costs no margin) on
the device when the clipped sum is built (``privacy.path_timing``), as cuDNN times its convolution
algorithms; a run's clip_paths.json says what was chosen and the times it was chosen from.

Every choice here is a speed choice only: each path and precision clips with a proven upper bound of
the norm (``privacy.rounding``), so a lower precision costs a larger margin, never the bound.
``BACKEND_TUNING`` is the one place where each backend's settings live; tests force any backend's
settings on a CPU, which runs the same arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from dpscale.errors import InvalidConfigError
from dpscale.privacy.checks import check_choice
from dpscale.privacy.rounding import ClipPrecision

Choice = Literal["rule", "measure"]
CHOICES: tuple[str, ...] = ("rule", "measure")
# Bytes of one chunk's per-example working set (patches, Gram matrices) on a CPU: about what stays
# in its last-level cache; measured fastest, per layer, on a 2-core CPU.
CPU_CHUNK_BYTES = 8 * 2**20
# Per-example work of a whole micro-batch at once: the device's memory, not a cache, is the limit. A
# candidate too large for it fails its timing and is never chosen (``privacy.path_timing``); one that
# fits alone but not beside the step's other buffers is not caught before the step runs.
WHOLE_MICROBATCH = 2**62


_HIGHEST, _TF32 = ClipPrecision(), ClipPrecision(norms="tf32", sums="tf32")
STRATEGIES: tuple[str, ...] = ("ghost", "explicit", "streamed")


@dataclasses.dataclass(frozen=True)
class DeviceTuning:
    """``precision``: the contractions' formats where nothing is measured (book-keeping layers, the
    rule); ``chunk_bytes``: one chunk's per-example working set; ``choose``: each layer's path and
    precision by the shape rule, or the fastest of ``candidates`` ((path, precision) pairs) timed
    on the device."""

    precision: ClipPrecision = _HIGHEST
    chunk_bytes: int = CPU_CHUNK_BYTES
    choose: Choice = "rule"
    candidates: tuple[tuple[str, ClipPrecision], ...] = tuple((s, _HIGHEST) for s in STRATEGIES)

    def __post_init__(self) -> None:
        check_choice(self.choose, CHOICES, "how paths are chosen")
        if self.chunk_bytes < 1 or not self.candidates:
            raise InvalidConfigError("chunk_bytes must be positive and candidates non-empty")
        for strategy, _ in self.candidates:
            check_choice(strategy, STRATEGIES, "a candidate's path")

    def with_precision(self, precision: ClipPrecision) -> DeviceTuning:
        """These settings with every contraction at ``precision`` (each path a candidate)."""
        return dataclasses.replace(self, precision=precision, candidates=tuple((s, precision) for s in STRATEGIES))


# TF32 only where it costs no margin: explicit (and book-keeping) norms are of the held gradients
# that are summed, so their bound stays within ~1e-5 of the norm at TF32; the ghost and streamed
# bounds cover TF32's rounding of products they do not hold, measured 34% and 5.7% above the norm
# on WRN-16-4 (docs/privacy.md, "Sensitivity under floating point"): a clipped example would lose
# that much of its signal against the same noise, for a faster step.
_ACCELERATOR = DeviceTuning(
    chunk_bytes=WHOLE_MICROBATCH,
    choose="measure",
    candidates=(("ghost", _HIGHEST), ("streamed", _HIGHEST), ("explicit", _HIGHEST), ("explicit", _TF32)),
)
BACKEND_TUNING: dict[str, DeviceTuning] = {
    "cpu": DeviceTuning(),
    "gpu": _ACCELERATOR,
    "cuda": _ACCELERATOR,
    "rocm": _ACCELERATOR,
    "tpu": _ACCELERATOR,
}


def tuning_for(backend: str | None = None) -> DeviceTuning:
    """The settings of ``backend`` (``jax.default_backend()`` unless named); a backend not listed
    gets the CPU's, which assume nothing of the device."""
    return BACKEND_TUNING.get(backend or jax.default_backend(), DeviceTuning())
