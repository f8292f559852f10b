"""How the per-layer clipped sum is tuned for the device it runs on: precision, chunking, how paths are
chosen.

Why: the fastest way to clip differs between devices. On a 2-core CPU per-example work runs best in
cache-sized chunks of examples (``lax.map``) at full float32, and a shape rule measured there
(``ghost.GHOST_RATIO``) picks each layer's path. On a GPU a chunked loop is a sequential loop of
small kernels, full float32 contractions skip the tensor cores (the non-private step's convolutions
use them), and a rule measured on a CPU says nothing about the cost of a Gram matrix against a held
gradient there. So a GPU or TPU runs each micro-batch's per-example work at once, and chooses each
distinct layer shape's path (and precision, where a lower one costs no margin) within a memory
budget: by a cost model whose constants were measured on that kind of device (``privacy.tuning.cost``;
NVIDIA GPUs), or, where none was, by timing the candidates on the device when the clipped sum is
built (``privacy.tuning.timing``), as cuDNN times its convolution algorithms. A run's clip_paths.json
says what was chosen, from what estimates or times, and what was left out or chunked.

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
from dpscale.privacy.layer_bounds import DEFAULT_CHUNK_BYTES
from dpscale.privacy.rounding import ClipPrecision

Choice = Literal["rule", "estimate", "measure"]
CHOICES: tuple[str, ...] = ("rule", "estimate", "measure")
# Bytes of one chunk's per-example working set (patches, Gram matrices) on a CPU: about what stays
# in its last-level cache; measured fastest, per layer, on a 2-core CPU.
CPU_CHUNK_BYTES = DEFAULT_CHUNK_BYTES
# A chunk_bytes no layer reaches: a micro-batch's per-example work runs at once, where the device's
# memory, not a cache, is the limit. The memory guard (``tuning.cost.fit``) chunks a layer whose
# estimated working set exceeds ``MEMORY_FRACTION`` of the device's memory, and drops a path whose
# held gradients alone exceed it.
UNLIMITED_CHUNK_BYTES = 2**62
# One layer's per-example work may take this fraction of the device's memory: the rest is the step's
# parameters, activations, recorded layer inputs and output gradients, and XLA's own buffers.
MEMORY_FRACTION = 0.25
# Where the device does not say how much memory it has (``memory_stats()`` is None on a CPU): the
# smallest current accelerators' (16 GiB: V100, TPU v5e).
DEFAULT_DEVICE_BYTES = 16 * 2**30


_HIGHEST, _TF32 = ClipPrecision(), ClipPrecision(norms="tf32", sums="tf32")
STRATEGIES: tuple[str, ...] = ("ghost", "explicit", "streamed")
# Every path a layer can be forced to or timed on: ``grouped`` (explicit, formed as a grouped
# convolution) has no measured cost yet, so neither the shape rule nor an estimate picks it.
ALL_STRATEGIES: tuple[str, ...] = (*STRATEGIES, "grouped")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """A device's constants for the paths' cost model (``privacy.tuning.cost``): a micro-batch's
    candidate takes ``launch_seconds`` a chunk plus its multiply-adds at ``macs_per_second`` of its
    contraction format and its bytes moved at ``bytes_per_second``."""

    macs_per_second: tuple[tuple[str, float], ...]  # (format, rate): ("highest", 2e13), ...
    bytes_per_second: float
    launch_seconds: float

    def rate(self, fmt: str) -> float:
        """Multiply-adds a second at ``fmt``; a format not measured gets the fastest rate known (its
        candidates then look cheap, and are timed rather than pruned)."""
        return dict(self.macs_per_second).get(fmt, max(rate for _, rate in self.macs_per_second))


# Fitted to the per-layer timings of benchmarks/results/gpu_step_cost.md (one H200, jax 0.11.2, WRN-16-4,
# micro-batch 256; 6 layer shapes x 4 candidates at K = 1, two at K = 4): each candidate's estimate to
# each layer's cheapest is within 1.67x of the measured ratio either way (benchmarks/clip_candidates.py
# prints both), so a candidate pruned at 8x measured at least ~5x the fastest there. Rates are
# effective ones (HIGHEST float32 ~2e13 multiply-adds/s, TF32 ~1e14; HBM ~4 TB/s; ~0.2 ms a candidate
# for its launches however small the layer).
H200_COST = CostModel(macs_per_second=(("highest", 2e13), ("tf32", 1e14)), bytes_per_second=4e12, launch_seconds=2e-4)


@dataclasses.dataclass(frozen=True)
class DeviceTuning:
    """``precision``: the contractions' formats where nothing is measured (book-keeping layers, the
    rule); ``chunk_bytes``: one chunk's per-example working set; ``choose``: each layer's path and
    precision by the shape rule, the cheapest of ``candidates`` ((path, precision) pairs) by the
    device's cost model (``estimate``: nothing compiled), or the fastest of them timed on the device
    (``measure``). ``cost``: the device's cost model, which also leaves out of the timing each
    candidate estimated at ``prune_factor`` times the cheapest or more (None: every candidate is timed);
    ``memory_bytes``: what one layer's per-example work may take at once (None:
    ``MEMORY_FRACTION`` of the device's memory)."""

    precision: ClipPrecision = _HIGHEST
    chunk_bytes: int = CPU_CHUNK_BYTES
    choose: Choice = "rule"
    candidates: tuple[tuple[str, ClipPrecision], ...] = tuple((s, _HIGHEST) for s in STRATEGIES)
    cost: CostModel | None = None
    prune_factor: float = 8.0
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        check_choice(self.choose, CHOICES, "how paths are chosen")
        if self.choose == "estimate" and self.cost is None:
            raise InvalidConfigError("choosing paths by estimate needs the device's cost model (cost)")
        if self.chunk_bytes < 1 or not self.candidates:
            raise InvalidConfigError("chunk_bytes must be positive and candidates non-empty")
        if self.prune_factor <= 1 or (self.memory_bytes is not None and self.memory_bytes < 1):
            raise InvalidConfigError("prune_factor must exceed 1 and memory_bytes be positive")
        for strategy, _ in self.candidates:
            check_choice(strategy, ALL_STRATEGIES, "a candidate's path")

    def with_precision(self, precision: ClipPrecision) -> DeviceTuning:
        """These settings with every contraction at ``precision`` (each path a candidate)."""
        return dataclasses.replace(self, precision=precision, candidates=tuple((s, precision) for s in STRATEGIES))


# TF32 only where it costs no margin: explicit (and book-keeping) norms are of the held gradients
# that are summed, so their bound stays within ~1e-5 of the norm at TF32; the ghost and streamed
# bounds cover TF32's rounding of products they do not hold, measured 34% and 5.7% above the norm
# on WRN-16-4 (docs/privacy.md, "Sensitivity under floating point"): a clipped example would lose
# that much of its signal against the same noise, for a faster step.
# Only NVIDIA GPUs have a measured cost model, and there it chooses: timing the candidates took
# minutes of a first run on an H200 (WRN-16-4), while the model's choices cost little step time
# against the timed ones there (benchmarks/results/gpu_step_cost.md has both).
# Other NVIDIA GPUs use the H200's constants too, unmeasured; elsewhere every candidate is timed.
_ACCELERATOR = DeviceTuning(
    chunk_bytes=UNLIMITED_CHUNK_BYTES,
    choose="measure",
    candidates=(("ghost", _HIGHEST), ("streamed", _HIGHEST), ("explicit", _HIGHEST), ("explicit", _TF32)),
)
_NVIDIA = dataclasses.replace(_ACCELERATOR, cost=H200_COST, choose="estimate")
BACKEND_TUNING: dict[str, DeviceTuning] = {
    "cpu": DeviceTuning(),
    "gpu": _NVIDIA,
    "cuda": _NVIDIA,
    "rocm": _ACCELERATOR,
    "tpu": _ACCELERATOR,
}


# For measuring on an NVIDIA GPU what its cost model cannot yet say: each layer's held-gradient paths
# timed on the device, explicit (from patches) against grouped (one grouped convolution), beside ghost.
# Benchmarks name it (``--clip-tuning gpu-timed``); no backend runs it by default.
GPU_TIMED = dataclasses.replace(
    _NVIDIA, choose="measure", candidates=(("explicit", _TF32), ("grouped", _TF32), ("ghost", _HIGHEST))
)
NAMED_TUNING: dict[str, DeviceTuning] = {**BACKEND_TUNING, "gpu-timed": GPU_TIMED}


def tuning_for(backend: str | None = None) -> DeviceTuning:
    """The settings of ``backend`` (the running one unless named); a backend not listed gets the
    CPU's, which assume nothing of the device."""
    return BACKEND_TUNING.get(backend or _running_backend(), DeviceTuning())


def _running_backend() -> str:
    """``jax.default_backend()``, but ``rocm`` for a "gpu" that is not NVIDIA's: JAX names both GPU
    kinds "gpu", and only NVIDIA's have a measured cost model (the others time their candidates)."""
    backend = jax.default_backend()
    if backend == "gpu" and not jax.devices()[0].device_kind.upper().startswith("NVIDIA"):
        return "rocm"
    return backend


def memory_budget(tuning: DeviceTuning) -> int:
    """Bytes one layer's per-example work may take at once: ``tuning.memory_bytes``, else
    ``MEMORY_FRACTION`` of the first local device's ``bytes_limit`` (``DEFAULT_DEVICE_BYTES`` where
    the device does not say)."""
    if tuning.memory_bytes is not None:
        return tuning.memory_bytes
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(MEMORY_FRACTION * int(stats.get("bytes_limit") or DEFAULT_DEVICE_BYTES))
