"""A finished run's parameters come back as saved, and a damaged or missing file is one line naming it."""

import json
import os

import numpy as np
import pytest

from dpscale.errors import DataError
from dpscale.training.checkpoints import check_digests, file_digests, restore_on_first_device, save_with_digests


@pytest.fixture
def saved(tmp_path):
    directory, digests = str(tmp_path / "params"), str(tmp_path / "params.sha256.json")
    save_with_digests(
        directory, digests_file=digests, params={"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, model_state={}
    )
    return directory, json.loads(open(digests).read())


def test_saved_parameters_come_back_with_the_digests_of_every_file(saved):
    directory, recorded = saved
    assert recorded == file_digests(directory) and recorded  # every file, by relative path
    check_digests(directory, recorded, run="r")
    restored = restore_on_first_device(directory, run="r")
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(6, dtype=np.float32).reshape(2, 3))


def test_a_changed_or_missing_file_is_refused_by_name(saved):
    directory, recorded = saved
    name = max(recorded, key=lambda n: os.path.getsize(os.path.join(directory, n)))
    with open(os.path.join(directory, name), "r+b") as f:
        f.write(b"\0damaged")
    with pytest.raises(DataError, match=f"'r': its saved parameters are damaged: params/{name} is corrupt"):
        check_digests(directory, recorded, run="r")
    os.remove(os.path.join(directory, name))
    with pytest.raises(DataError, match=f"params/{name} is missing"):
        check_digests(directory, recorded, run="r")


def test_unreadable_parameters_are_one_line(tmp_path):
    with pytest.raises(DataError, match=r"'r': its saved parameters \(params/\) are damaged"):
        restore_on_first_device(str(tmp_path / "params"), run="r")
