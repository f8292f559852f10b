"""A second decision for pairs the alignment grid rejects: continuous alignment, then detail.

Real CIFAR-10 duplicates are often re-cropped or zoomed by more than the grid of
``dedup.verify`` covers (scales 0.78-1.12, whole-pixel shifts), or resampled anisotropically;
the grid's best point then leaves the detail misaligned and the pair fails. Here the
private image is aligned to the public one by an affine warp fitted by maximising the
enhanced correlation coefficient (OpenCV's ``findTransformECCWithMask``, Evangelidis &
Psarakis 2008) on blurred luma over the public image's central window (the template mask: a
re-crop's new border stays out), from three starting scales, each fit scored here at the warp
it returns (OpenCV's own coefficient is that of the step before); the pair is a duplicate only if

* the fitted warp is close to a re-crop (singular-value ratio <= ``MAX_ANISOTROPY``, scale in
  ``SCALE_RANGE``; CIFAR-10's copies are often resampled to another aspect ratio);
* the blurred luma's *rank* correlation over the window (Spearman's: Pearson's on the pixels'
  ranks) is >= ``MIN_RANK`` after the warp. Pearson's correlation of a dark silhouette on a
  plain ground is high for any aligned look-alike (two grey levels dominate it); ranks weigh
  every pixel's order, so the ground's own shading must agree too, and they ignore monotonic
  contrast changes (gamma, curves) that real copies have and Pearson's penalises; and
* the detail band (luma blurred at 0.7 px minus blurred at 3 px) correlates (>=
  ``MIN_DETAIL``): an aeroplane on an empty sky matches another one's outline, not its
  edges and texture.

Why cuts and not a learned rule: on the by-eye labels of the census of real CIFAR-10
duplicates (``benchmarks/results/dedup.md``) a cross-validated logistic regression on these and
nine more features accepted only a few more real duplicates at the same number of look-alikes,
and cuts can be read and checked. The cuts were chosen on by-eye labels of refined pairs and
checked on a fresh sample (``benchmarks/results/dedup.md``). ECC itself comes from OpenCV;
nothing here re-implements it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SIZE = 32  # px: every image is compared at 32x32 luma, like the grid's fine pass
WINDOW = (4, 28)  # central 24x24 of 32x32, as the grid's window: a re-crop's border is left out
START_SCALES = (0.85, 1.0, 1.2)
ITERATIONS = 30
EPSILON = 1e-4
ECC_BLUR = 1.0  # px: both images are blurred before ECC (JPEG noise, sub-pixel resampling)
ECC_FILTER = 3  # OpenCV's own Gaussian filter size inside ECC
DETAIL_BAND = (0.7, 3.0)  # px: difference of Gaussians compared after the warp
MIN_RANK = 0.95
MIN_DETAIL = 0.8
MAX_ANISOTROPY = 1.5
SCALE_RANGE = (0.65, 1.5)
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)


@dataclasses.dataclass(frozen=True)
class Refined:
    """Per pair, after the fitted warp: 1 - the blurred luma's (Pearson, ECC's) correlation,
    1 - its rank correlation, 1 - the detail correlation; the warp's scale and anisotropy.

    ``inf`` distances: ECC did not converge from any start (flat or unrelated images).
    """

    ecc_distance: np.ndarray
    rank_distance: np.ndarray
    detail_distance: np.ndarray
    scale: np.ndarray
    anisotropy: np.ndarray

    @property
    def accepted(self) -> np.ndarray:
        lo, hi = SCALE_RANGE
        return (
            (self.rank_distance <= 1 - MIN_RANK)
            & (self.detail_distance <= 1 - MIN_DETAIL)
            & (self.anisotropy <= MAX_ANISOTROPY)
            & (self.scale >= lo)
            & (self.scale <= hi)
        )


def _luma(image: np.ndarray) -> np.ndarray:
    """uint8 [H, W, C] -> luma float32 [32, 32] (other sizes resampled, as the grid does)."""
    import cv2

    x = image.astype(np.float32) / 255.0
    y = np.ascontiguousarray(x[..., 0] if x.shape[-1] == 1 else x[..., :3] @ _LUMA)
    if y.shape != (SIZE, SIZE):
        shrink = y.shape[0] > SIZE and y.shape[1] > SIZE
        y = cv2.resize(y, (SIZE, SIZE), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    return y


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = float(np.sqrt(np.square(a).sum() * np.square(b).sum()))
    return float((a * b).sum() / den) if den > 1e-12 else 0.0


def opencv_version() -> str:
    """Recorded in the report: ECC's fit, so the decisions near a cut, can move between versions."""
    import cv2

    return cv2.__version__


def _warp(image: np.ndarray, warp: np.ndarray) -> np.ndarray:
    """``image`` resampled into the public frame: out(x) = image(warp @ [x, 1])."""
    import cv2

    return cv2.warpAffine(
        image, warp, (SIZE, SIZE), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_REPLICATE
    )


def _ranks(x: np.ndarray) -> np.ndarray:
    from scipy.stats import rankdata

    return rankdata(x, method="average").astype(np.float32)


def _refine_one(public: np.ndarray, private: np.ndarray) -> tuple[float, ...]:
    import cv2

    a, b = _luma(public), _luma(private)
    lo, hi = WINDOW
    window = np.zeros((SIZE, SIZE), np.uint8)
    window[lo:hi, lo:hi] = 1
    everywhere = np.ones((SIZE, SIZE), np.uint8)
    ta = cv2.GaussianBlur(a, (0, 0), ECC_BLUR)
    tb = cv2.GaussianBlur(b, (0, 0), ECC_BLUR)
    criteria = (cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, ITERATIONS, EPSILON)
    centre = (SIZE - 1) / 2
    best, warp = -1.0, None
    for s in START_SCALES:
        start = np.array([[s, 0, centre - s * centre], [0, s, centre - s * centre]], np.float32)
        try:  # the criterion over the public window only (the template mask), as documented above
            _, w = cv2.findTransformECCWithMask(
                ta, tb, window, everywhere, start, cv2.MOTION_AFFINE, criteria, ECC_FILTER
            )
        except cv2.error:  # did not converge, or a flat image: no evidence from this start
            continue
        if not np.all(np.isfinite(w)):
            continue
        # OpenCV's returned coefficient belongs to the warp before its last update: score the
        # returned warp ourselves, on the same window, and pick the start by that score
        cc = _correlation(ta[lo:hi, lo:hi], _warp(tb, w)[lo:hi, lo:hi])
        if cc > best:
            best, warp = cc, w
    if warp is None:
        return float("inf"), float("inf"), float("inf"), 0.0, float("inf")
    rank = _correlation(_ranks(ta[lo:hi, lo:hi]), _ranks(_warp(tb, warp)[lo:hi, lo:hi]))

    def band(y: np.ndarray) -> np.ndarray:
        fine, coarse = DETAIL_BAND
        return (cv2.GaussianBlur(y, (0, 0), fine) - cv2.GaussianBlur(y, (0, 0), coarse))[lo:hi, lo:hi]

    detail = _correlation(band(a), band(_warp(b, warp)))
    sv = np.linalg.svd(warp[:, :2].astype(np.float64), compute_uv=False)
    anisotropy = float(sv[0] / sv[1]) if sv[1] > 1e-9 else float("inf")
    return 1.0 - best, 1.0 - rank, 1.0 - detail, float(np.sqrt(sv[0] * sv[1])), anisotropy


def refine(public: np.ndarray, private: np.ndarray, mirrored: np.ndarray) -> Refined:
    """Refine pairs (public[i], private[i]) (uint8 [n, H, W, C]); ``mirrored[i]``: flip private."""
    import cv2

    # One thread: each call is a 32x32 problem, and the runner already runs a process per core;
    # the caller's setting is restored (results do not depend on it).
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        rows = [
            _refine_one(a, b[:, ::-1] if m else b)
            for a, b, m in zip(public, private, np.asarray(mirrored, bool), strict=True)
        ]
    finally:
        cv2.setNumThreads(threads)
    cols = np.array(rows, np.float64).reshape(-1, 5).T
    return Refined(*(c.astype(np.float32) for c in cols))
