"""Feature-cache keys: equal parts give equal digests, any changed part a new one."""

import dataclasses

import pytest

from dpscale.cache.keys import FEATURE_FORMAT_VERSION, FeatureKey
from dpscale.errors import DataError

BASE = FeatureKey(data_content_hash="a" * 64, weights_sha256="b" * 64, model="efficientnet-lite0",
                  resolution=224, mean=(127.0, 127.0, 127.0), std=(128.0, 128.0, 128.0))


def test_digest_is_stable_and_survives_a_round_trip():
    again = FeatureKey.from_dict(BASE.as_dict())
    assert again == BASE
    assert again.digest == BASE.digest
    assert len(BASE.digest) == 64
    assert BASE.format_version == FEATURE_FORMAT_VERSION
    # ints and floats of the same value are the same key
    assert dataclasses.replace(BASE, mean=(127, 127, 127)).digest == BASE.digest


@pytest.mark.parametrize("change", [
    {"data_content_hash": "c" * 64}, {"weights_sha256": "d" * 64}, {"resolution": 128},
    {"mean": (127.0, 127.0, 127.5)}, {"std": (128.0, 128.0, 127.0)},
    {"resize_method": "nearest"}, {"format_version": FEATURE_FORMAT_VERSION + 1},
    {"model": "efficientnet-lite1"}])
def test_every_part_changes_the_digest(change):
    assert dataclasses.replace(BASE, **change).digest != BASE.digest


def test_bad_keys_are_data_errors():
    with pytest.raises(DataError, match="resize method"):
        dataclasses.replace(BASE, resize_method="area")
    with pytest.raises(DataError, match="content hash"):
        dataclasses.replace(BASE, data_content_hash="")
    with pytest.raises(DataError, match="malformed"):
        FeatureKey.from_dict({**BASE.as_dict(), "colour": "blue"})
