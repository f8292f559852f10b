"""What dedup compares first: a blurred, normalised thumbnail per view of an image.

Real near duplicates differ from their twin by a re-crop shifted by a pixel or two, a slightly
different scale, other colours or brightness, JPEG, a mirror. A 16x16 luma thumbnail taken
with a Gaussian kernel one thumbnail pixel wide barely changes under a 1-2 px shift or a
5-10% rescale; subtracting its mean and scaling it to unit length removes brightness and
contrast; the 8x8 chroma thumbnail (normalised on its own, half weight) keeps colour layout
but not colour casts. Cosine similarity of two descriptors is then a normalised correlation of
two blurred images: 1 for copies, ~0.5 for unrelated pictures of similar layout.

Views. The private side is embedded as 12 views: the whole image and five crops keeping
88% of each side (centre and corners), each also mirrored, so a flipped, shifted or cropped
public copy lies near one view. Each view is one box sampled by two small matrices (the
sampling is separable and linear), so a view costs two matrix products. Views go on the
private side only: it is the small one.

Cost: a descriptor is the lowest 8x8 luma and 4x4 chroma DCT frequencies of those
thumbnails (96 float32 numbers; planted copies ranked as with all 384); nearest neighbours are one blocked matrix
product over (private views x public images) (``dedup.knn``). The descriptor is a candidate
generator, not the decision: ``dedup.verify`` decides.
"""

from __future__ import annotations

import functools

import numpy as np

LUMA = 16  # luma thumbnail side
CHROMA = 8  # chroma thumbnail side (per channel)
LUMA_KEEP, CHROMA_KEEP = 8, 4  # lowest DCT frequencies kept per axis
SIGMA = 1.0  # Gaussian sampling kernel, in thumbnail pixels
CHROMA_WEIGHT = 0.5
CROP = 0.88  # share of each side a crop view keeps
DIM = LUMA_KEEP * LUMA_KEEP + 2 * CHROMA_KEEP * CHROMA_KEEP
_YCBCR = np.array([[0.299, 0.587, 0.114], [-0.169, -0.331, 0.5], [0.5, -0.419, -0.081]], dtype=np.float32)

Box = tuple[float, float, float, float]  # left, top, right, bottom as shares of the side


def view_boxes(crop: float = CROP) -> tuple[Box, ...]:
    """The whole image, then crops keeping ``crop`` of each side at the centre and corners."""
    m = 1.0 - crop
    boxes = [(0.0, 0.0, 1.0, 1.0)]
    for x, y in ((0.5, 0.5), (0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)):
        boxes.append((x * m, y * m, x * m + crop, y * m + crop))
    return tuple(boxes)


VIEWS = view_boxes()
NUM_VIEWS = 2 * len(VIEWS)  # each box plain and mirrored


def view_of(number: int) -> tuple[Box, bool]:
    """View ``number`` -> (box, mirrored): views 0..5 plain, 6..11 the same boxes mirrored."""
    return VIEWS[number % len(VIEWS)], number >= len(VIEWS)


def view_name(number: int) -> str:
    box, mirrored = view_of(number)
    where = ("whole", "centre crop", "top-left crop", "top-right crop", "bottom-left crop", "bottom-right crop")[
        number % len(VIEWS)
    ]
    return f"{where}{' mirrored' if mirrored else ''}"


@functools.lru_cache(maxsize=256)
def sampling_matrix(size: int, out: int, lo: float, hi: float, sigma: float) -> np.ndarray:
    """[out, size]: Gaussian samples at ``out`` evenly spaced centres of [lo, hi) (shares)."""
    lo, hi = lo * size, hi * size
    centres = lo + (np.arange(out) + 0.5) * (hi - lo) / out - 0.5
    width = sigma * (hi - lo) / out
    w = np.exp(-0.5 * ((np.arange(size)[None] - centres[:, None]) / width) ** 2)
    return (w / w.sum(1, keepdims=True)).astype(np.float32)


@functools.lru_cache(maxsize=4)
def _dct(n: int, keep: int) -> np.ndarray:
    """[keep, n]: the lowest ``keep`` rows of the orthonormal DCT-II of length n."""
    k = np.arange(n)
    m = np.cos(np.pi * (k[None] + 0.5) * k[:, None] / n) * np.sqrt(2 / n)
    m[0] /= np.sqrt(2)
    return m[:keep].astype(np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    x = x - x.mean(1, keepdims=True)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-3)


def describe(images: np.ndarray, box: Box = VIEWS[0], *, mirror: bool = False) -> np.ndarray:
    """uint8 [n, H, W, C] -> unit float32 [n, DIM] descriptors of one view."""
    x = images.astype(np.float32) / 255.0
    if x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    x = x[..., :3] @ _YCBCR.T
    if mirror:
        x = x[:, :, ::-1]
    n, h, w, _ = x.shape
    left, top, right, bottom = box

    def sample(channels: np.ndarray, out: int, sigma: float) -> np.ndarray:
        rows = sampling_matrix(h, out, top, bottom, sigma)
        cols = sampling_matrix(w, out, left, right, sigma)
        return np.einsum("ij,njkc,lk->ncil", rows, channels, cols, optimize=True)

    luma = _unit(sample(x[..., :1], LUMA, SIGMA).reshape(n, -1)).reshape(n, LUMA, LUMA)
    chroma = sample(x[..., 1:], CHROMA, SIGMA * LUMA / CHROMA)
    chroma = chroma - chroma.mean(axis=(2, 3), keepdims=True)
    norm = np.sqrt(np.square(chroma).sum(axis=(1, 2, 3), keepdims=True))
    chroma = chroma / np.maximum(norm, 1e-3)
    # the thumbnails are blurred: their lowest DCT frequencies hold nearly all of them, and
    # the basis is orthonormal, so cosines barely change while the search gets 4x cheaper
    ly, cy = _dct(LUMA, LUMA_KEEP), _dct(CHROMA, CHROMA_KEEP)
    luma = np.einsum("ij,njk,lk->nil", ly, luma, ly, optimize=True).reshape(n, -1)
    chroma = np.einsum("ij,ncjk,lk->ncil", cy, chroma, cy, optimize=True).reshape(n, -1)
    d = np.concatenate([luma, CHROMA_WEIGHT * chroma], axis=1)
    return (d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-6)).astype(np.float32)


def describe_views(images: np.ndarray) -> np.ndarray:
    """uint8 [n, H, W, C] -> float32 [NUM_VIEWS, n, DIM]: every view of every image."""
    views = [view_of(v) for v in range(NUM_VIEWS)]
    return np.stack([describe(images, box, mirror=mirrored) for box, mirrored in views])
