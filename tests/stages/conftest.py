"""Shared test data for the stage tests."""

import numpy as np
import pytest

from dpscale.cache.feature_store import EntryLayout, FeatureStore, SplitLayout
from dpscale.cache.keys import FeatureKey


def write_synthetic_feature_cache(root: str, *, seed: int, sizes: dict[str, int], chunk_rows: int,
                                  data_hash_char: str) -> str:
    """A separable 3-class problem in 16 dimensions, stored as a real, complete cache entry."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(3, 16)) * 3
    key = FeatureKey(data_content_hash=data_hash_char * 64, weights_sha256="w" * 64, model="synthetic",
                     resolution=8, mean=(0.0,), std=(1.0,))
    layout = EntryLayout(key=key, feature_dim=16, class_names=("a", "b", "c"),
                         splits={s: SplitLayout(num_examples=n, chunk_rows=chunk_rows) for s, n in sizes.items()})
    store = FeatureStore.create(root, layout)
    for split, n in sizes.items():
        labels = rng.integers(0, 3, size=n)
        feats = centers[labels] + rng.normal(size=(n, 16))
        rows = layout.splits[split]
        for chunk in range(rows.num_chunks):
            start, stop = rows.rows(chunk)
            ids = [i.to_bytes(32, "little") for i in range(start, stop)]
            store.write_chunk(split, chunk, feats[start:stop], labels[start:stop], ids)
    store.finalize()
    return store.path


@pytest.fixture(scope="session")
def synthetic_feature_cache():
    """``write_synthetic_feature_cache`` for module-scoped fixtures."""
    return write_synthetic_feature_cache
