"""Near-duplicate signatures of images: what ``dpscale dedup`` compares and buckets.

Method (why this one):

* **Embedding.** The image (YCbCr) is area-resampled to a 32x32 thumbnail and the
  lowest frequencies of its 2-D DCT-II are kept: 6x6 of luma without the DC term and
  3x3 of each chroma channel, 53 numbers scaled to unit length. This is the perceptual
  hash (pHash) idea kept as a real vector instead of sign bits: low frequencies survive
  JPEG re-encoding, resizing and small shifts; dropping the luma DC and normalising
  makes it blind to brightness and contrast; the chroma terms cut false matches between
  unrelated images of similar layout (measured: benchmarks/results/dedup.md). The exact
  distance stays informative near the threshold, where sign bits are noisy.
  Distance = Euclidean distance of two embeddings (``sqrt(2 - 2 cos)``, in [0, 2]).
  Resampling and DCT are both linear and separable, so a view of any crop box is two
  small matrix products: hundreds of views per image cost little.
* **Flips and crops.** Every *private* image is embedded as many *views*: the whole
  image, crops on a 5x5 grid of positions at six scales (95% down to 70% of each
  side), and the horizontal mirror of each.
  A flipped public copy then matches the mirrored view exactly, and a cropped and
  rescaled copy lands near the view of the closest crop. Views go on the private side
  only, because the private set is the small one (1.3M vs 300M public images).
* **Candidates by LSH.** Random-hyperplane signs (SimHash) of an embedding, cut into
  bands of a few bits; two embeddings are candidates when any band agrees. Collision odds
  per band are ``(1 - angle/pi) ** bits``, so near pairs meet in some band almost surely
  and unrelated ones rarely. The Beam graph groups by band value, so no worker ever sees
  all pairs, and only candidates get the exact distance check.
* **Verification.** LSH + the 53-number distance leave false matches between images
  with little structure (a small aeroplane on plain sky). Each surviving pair is checked
  once more at a finer level: 12x12 luma DCT + chroma, minimised over 75 boxes around
  the matched view (+-2.5% shifts, +-3% scale), so the alignment is refined before the
  finer, less shift-tolerant comparison. Only matched pairs pay for it.
* **Flat images.** An image without structure (all terms ~0) has no direction; it
  gets a zero embedding (distance 1 to everything with structure) and a reserved bucket,
  and two flat images are compared by mean gray level instead.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from collections.abc import Sequence

import numpy as np

THUMB = 32  # thumbnail side the DCT sees
LUMA = 6  # luma DCT block side (DC dropped)
FINE_LUMA = 12  # luma block side of the verification features
CHROMA = 3  # chroma DCT block side per channel (DC kept)
DIM = LUMA * LUMA - 1 + 2 * CHROMA * CHROMA
FLAT_ENERGY = 1e-3  # norm (gray levels / 255) below which an image is "flat"
FLAT_BUCKET = np.uint64(2**64 - 1)  # reserved band value for flat images
LSH_SEED = 20221013  # fixed: every worker must draw the same hyperplanes
_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
_YCBCR = np.array([[0.299, 0.587, 0.114], [-0.169, -0.331, 0.5], [0.5, -0.419, -0.081]],
                  dtype=np.float32)

Box = tuple[float, float, float, float]  # left, top, right, bottom in pixels


@dataclasses.dataclass(frozen=True)
class HashConfig:
    """Views of private images and LSH banding; ``threshold`` is the duplicate cut."""

    threshold: float = 0.25
    verify_threshold: float = 0.15  # fine distance cut of the verification; 0 = no check
    crop_scales: tuple[float, ...] = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
    bands: int = 8
    bits_per_band: int = 8

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if not 0.0 <= self.verify_threshold < 2.0:
            raise ValueError(f"verify threshold must be in [0, 2), got {self.verify_threshold}")
        if any(not 0.3 <= s < 1.0 for s in self.crop_scales):
            raise ValueError(f"crop scales must be in [0.3, 1), got {self.crop_scales}")
        if not 1 <= self.bits_per_band <= 63 or self.bands < 1:
            raise ValueError("need at least one band of 1-63 bits")

    @property
    def num_views(self) -> int:
        return 2 * (1 + len(_GRID) ** 2 * len(self.crop_scales))


def view_boxes(height: int, width: int, scales: Sequence[float]) -> list[Box]:
    """The whole image, then per scale the crops on a 5x5 grid of positions."""
    boxes = [(0.0, 0.0, float(width), float(height))]
    for s in scales:
        cw, ch = width * s, height * s
        for fy in _GRID:
            for fx in _GRID:
                left, top = (width - cw) * fx, (height - ch) * fy
                boxes.append((left, top, left + cw, top + ch))
    return boxes


def _area_resample(n_in: int, start: float, stop: float) -> np.ndarray:
    """[THUMB, n_in]: output pixel i averages the input interval it covers (box filter)."""
    edges = start + (stop - start) * np.arange(THUMB + 1) / THUMB
    pixels = np.arange(n_in)[None, :]
    overlap = np.maximum(np.minimum(edges[1:, None], pixels + 1)
                         - np.maximum(edges[:-1, None], pixels), 0.0)
    return overlap / overlap.sum(axis=1, keepdims=True)


def _dct_rows(keep: int) -> np.ndarray:
    """The first ``keep`` rows of the orthonormal DCT-II matrix of size THUMB."""
    n = np.arange(THUMB)
    k = np.arange(keep)[:, None]
    basis = np.cos(np.pi * (2 * n + 1) * k / (2 * THUMB)) * np.sqrt(2.0 / THUMB)
    basis[0] /= np.sqrt(2.0)
    return basis


@functools.lru_cache(maxsize=4096)
def _projection(n_in: int, start: float, stop: float, keep: int = LUMA) -> np.ndarray:
    """[keep, n_in]: crop [start, stop), resample to THUMB, low DCT rows, in one matrix."""
    return (_dct_rows(keep) @ _area_resample(n_in, start, stop) / THUMB).astype(np.float32)


def _features(images: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
    """float32 YCbCr [n, H, W, 3] -> raw (unnormalised) features [n, len(boxes), dim]."""
    n, h, w, _ = images.shape
    py = np.stack([_projection(h, b[1], b[3]) for b in boxes])
    px = np.stack([_projection(w, b[0], b[2]) for b in boxes])
    rows = np.einsum("vki,nijc->nvkjc", py, images, optimize=True)
    coeffs = np.einsum("nvkjc,vlj->nvckl", rows, px, optimize=True)
    luma = coeffs[:, :, 0].reshape(n, len(boxes), -1)[..., 1:]
    chroma = coeffs[:, :, 1:, :CHROMA, :CHROMA].reshape(n, len(boxes), -1)
    return np.concatenate([luma, chroma], axis=2)


def to_ycbcr(images: np.ndarray) -> np.ndarray:
    """uint8 [n, H, W, C] (C = 1 or 3+) -> float32 YCbCr [n, H, W, 3] in [0, 1] units."""
    x = np.asarray(images, dtype=np.float32) / 255.0
    if x.shape[-1] == 1:
        return np.concatenate([x, np.zeros_like(x), np.zeros_like(x)], axis=-1)
    return x[..., :3] @ _YCBCR.T


def _normalise(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    norms = np.linalg.norm(raw, axis=1, keepdims=True)
    flat = norms[:, 0] < FLAT_ENERGY
    vectors = np.where(flat[:, None], 0.0, raw / np.maximum(norms, 1e-12))
    return vectors.astype(np.float32), flat


def embed(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Public side: uint8 [n, H, W, C] -> (unit embeddings [n, DIM], mean luma [n])."""
    x = to_ycbcr(images)
    box = (0.0, 0.0, float(x.shape[2]), float(x.shape[1]))
    vectors, _ = _normalise(_features(x, [box])[:, 0])
    return vectors, x[..., 0].mean(axis=(1, 2)).astype(np.float32)


def embed_views(images: np.ndarray, config: HashConfig) -> tuple[np.ndarray, np.ndarray]:
    """Private side: uint8 [n, H, W, C] -> ([n, num_views, DIM], mean luma [n]).

    Views are ordered as ``view_boxes`` then the same boxes on the mirrored image.
    """
    x = to_ycbcr(images)
    boxes = view_boxes(x.shape[1], x.shape[2], config.crop_scales)
    mirrored = x[:, :, ::-1]
    raw = np.concatenate([_features(x, boxes), _features(mirrored, boxes)], axis=1)
    vectors, _ = _normalise(raw.reshape(-1, DIM))
    return (vectors.reshape(len(images), len(boxes) * 2, DIM),
            x[..., 0].mean(axis=(1, 2)).astype(np.float32))


def refined_boxes(box: Box, height: int, width: int) -> list[Box]:
    """75 boxes around ``box``: scale x0.97/1/1.03, shifts of -2.5..2.5% per axis."""
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    hw, hh = (box[2] - box[0]) / 2, (box[3] - box[1]) / 2
    eps_x, eps_y = 0.0003 * width, 0.0003 * height
    out = []
    for s in (0.97, 1.0, 1.03):
        for fy in (-0.025, -0.0125, 0.0, 0.0125, 0.025):
            for fx in (-0.025, -0.0125, 0.0, 0.0125, 0.025):
                left, right = cx + fx * width - hw * s, cx + fx * width + hw * s
                top, bottom = cy + fy * height - hh * s, cy + fy * height + hh * s
                if left < -eps_x or top < -eps_y or right > width + eps_x or \
                        bottom > height + eps_y:
                    continue
                out.append((max(left, 0.0), max(top, 0.0), min(right, float(width)),
                            min(bottom, float(height))))
    return out


def fine_distance(public: np.ndarray, private: np.ndarray, view: int,
                  config: HashConfig) -> float:
    """Verification distance of a matched pair: finer features, refined alignment."""
    x, y = to_ycbcr(public[None]), to_ycbcr(private[None])
    per_side = config.num_views // 2
    mirror, index = divmod(view, per_side)
    if mirror:
        y = y[:, :, ::-1]
    h, w = y.shape[1:3]
    box = view_boxes(h, w, config.crop_scales)[index]
    boxes = refined_boxes(box, h, w) or [box]

    def fine(raw: np.ndarray) -> np.ndarray:
        luma = raw[..., :FINE_LUMA * FINE_LUMA]
        chroma = raw[..., FINE_LUMA * FINE_LUMA:]
        # same layout as DIM's: luma block without DC, then the chroma blocks
        return _normalise(np.concatenate([luma[..., 1:], chroma], axis=-1).reshape(
            -1, FINE_LUMA * FINE_LUMA - 1 + 2 * CHROMA * CHROMA))[0]

    a = fine(_fine_raw(x, [(0.0, 0.0, float(x.shape[2]), float(x.shape[1]))]))
    b = fine(_fine_raw(y, boxes))
    if not a.any() or not b.any(axis=1).all():  # flat: the coarse check decides
        return 0.0
    return float(np.sqrt(np.maximum(2.0 - 2.0 * (b.astype(np.float64) @ a[0]), 0.0)).min())


def _fine_raw(images: np.ndarray, boxes: Sequence[Box]) -> np.ndarray:
    """[len(boxes), FINE_LUMA**2 + 2 * CHROMA**2] of one image: full luma block + chroma."""
    n, h, w, _ = images.shape
    py = np.stack([_projection(h, b[1], b[3], FINE_LUMA) for b in boxes])
    px = np.stack([_projection(w, b[0], b[2], FINE_LUMA) for b in boxes])
    rows = np.einsum("vki,nijc->nvkjc", py, images, optimize=True)
    coeffs = np.einsum("nvkjc,vlj->nvckl", rows, px, optimize=True)[0]
    luma = coeffs[:, 0].reshape(len(boxes), -1)
    chroma = coeffs[:, 1:, :CHROMA, :CHROMA].reshape(len(boxes), -1)
    return np.concatenate([luma, chroma], axis=1)


def view_name(view: int, config: HashConfig) -> str:
    """Human-readable name of a view index (for the report)."""
    per_side = config.num_views // 2
    mirror, index = divmod(view, per_side)
    prefix = "flip+" if mirror else ""
    if index == 0:
        return prefix + "whole" if prefix else "whole"
    scale = config.crop_scales[(index - 1) // len(_GRID) ** 2]
    cell = (index - 1) % len(_GRID) ** 2
    fy, fx = _GRID[cell // len(_GRID)], _GRID[cell % len(_GRID)]
    return f"{prefix}crop{scale:g}@({fx:g},{fy:g})"


@functools.lru_cache(maxsize=8)
def _hyperplanes(bands: int, bits: int) -> np.ndarray:
    rng = np.random.default_rng(LSH_SEED)
    return rng.standard_normal((DIM, bands * bits)).astype(np.float32)


def band_values(vectors: np.ndarray, config: HashConfig) -> np.ndarray:
    """SimHash bands: uint64 [n, bands]; flat embeddings get FLAT_BUCKET in every band."""
    vectors = np.asarray(vectors, dtype=np.float32)
    signs = (vectors @ _hyperplanes(config.bands, config.bits_per_band)) > 0
    signs = signs.reshape(len(vectors), config.bands, config.bits_per_band)
    weights = np.uint64(1) << np.arange(config.bits_per_band, dtype=np.uint64)
    values = (signs.astype(np.uint64) * weights).sum(axis=2, dtype=np.uint64)
    values[~vectors.any(axis=1)] = FLAT_BUCKET
    return values


def distances(a: np.ndarray, mean_a: np.ndarray, b: np.ndarray,
              mean_b: np.ndarray) -> np.ndarray:
    """Pairwise distances [len(a), len(b)] between embeddings (see module docstring).

    Two flat images are at 4x their mean luma difference (a 0.25 cut then means about
    16 gray levels); a flat and a structured image are at distance 1.
    """
    a = np.asarray(a, dtype=np.float64)  # float32 cancellation would put twins at ~5e-4
    b = np.asarray(b, dtype=np.float64)
    sq = (np.square(a).sum(1)[:, None] + np.square(b).sum(1)[None, :] - 2.0 * (a @ b.T))
    d = np.sqrt(np.maximum(sq, 0.0))
    both = (~a.any(axis=1))[:, None] & (~b.any(axis=1))[None, :]
    return np.where(both, 4.0 * np.abs(mean_a[:, None] - mean_b[None, :]), d)


def jpeg_roundtrip(image: np.ndarray, quality: int = 75) -> np.ndarray:
    """Re-encode as JPEG at ``quality`` (for measuring robustness; pillow only)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(
        buf, format="JPEG", quality=quality)
    with Image.open(io.BytesIO(buf.getvalue())) as img:
        out = np.asarray(img.convert("L" if image.shape[-1] == 1 else "RGB"), np.uint8)
    return out[..., None] if out.ndim == 2 else out
