"""Feature-cache keys: equal parts give equal digests, any changed part a new one."""

import dataclasses

import pytest

from dpscale.cache.keys import FEATURE_FORMAT_VERSION, FeatureKey
from dpscale.errors import DataError

BASE = FeatureKey(
    data_identity="a" * 64,
    weights_sha256="b" * 64,
    model="efficientnet-lite0",
    resolution=224,
    mean=(127.0, 127.0, 127.0),
    std=(128.0, 128.0, 128.0),
)


def test_digest_is_stable_and_survives_a_round_trip():
    again = FeatureKey.from_dict(BASE.as_dict())
    assert again == BASE
    assert again.digest == BASE.digest
    assert len(BASE.digest) == 64
    assert BASE.format_version == FEATURE_FORMAT_VERSION
    # ints and floats of the same value are the same key
    assert dataclasses.replace(BASE, mean=(127, 127, 127)).digest == BASE.digest


@pytest.mark.parametrize(
    "change",
    [
        {"data_identity": "c" * 64},
        {"weights_sha256": "d" * 64},
        {"resolution": 128},
        {"mean": (127.0, 127.0, 127.5)},
        {"std": (128.0, 128.0, 127.0)},
        {"resize_method": "nearest"},
        {"format_version": FEATURE_FORMAT_VERSION + 1},
        {"model": "efficientnet-lite1"},
        {"cut": "blocks_12"},
        {"cut": "blocks_12", "views": 2},
        {"flip_average": True},
    ],
)
def test_every_part_changes_the_digest(change):
    assert dataclasses.replace(BASE, **change).digest != BASE.digest


def test_keys_without_flip_average_keep_the_digest_they_had_before_the_option():
    assert "flip_average" not in BASE.as_dict()
    # sha256 of the canonical JSON of the eight parts a key has without flip_average (format 2)
    format2 = dataclasses.replace(BASE, format_version=2)
    assert format2.digest == "903a3bad0bed1a0d4ad59182ae1cbeadb9a75a25cd38b838cc030ccfc7585767"
    flipped = dataclasses.replace(BASE, flip_average=True)
    assert FeatureKey.from_dict(flipped.as_dict()) == flipped


def test_bad_keys_are_data_errors():
    with pytest.raises(DataError, match="resize method"):
        dataclasses.replace(BASE, resize_method="area")
    with pytest.raises(DataError, match="data identity"):
        dataclasses.replace(BASE, data_identity="")
    with pytest.raises(DataError, match="malformed"):
        FeatureKey.from_dict({**BASE.as_dict(), "colour": "blue"})


def test_a_key_without_a_cut_has_the_digest_it_had_before_cuts_existed():
    """Parts at their defaults stay out of the digest: entries made earlier keep their names
    (the digest pinned here is the one computed before ``cut`` and ``views`` were parts)."""
    assert "cut" not in BASE.as_dict() and "views" not in BASE.as_dict()
    assert BASE.digest == "b0f01f8c34130b1bd6fe7e7eb09967c3dd41e1474865a011b91aed59b96a9c8a"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"views": 2}, "augmented views are cached at a cut only"),
        ({"cut": "blocks_3", "views": 0}, "views must be a positive integer"),
        ({"cut": "blocks_3", "flip_average": True}, "flip averaging applies to pooled features"),
    ],
)
def test_impossible_cut_keys_are_refused(change, message):
    with pytest.raises(DataError, match=message):
        dataclasses.replace(BASE, **change)
