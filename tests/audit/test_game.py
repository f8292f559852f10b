"""The audit's reports: statistics of models trained on the audited data, kept owner-only."""

import json
import os
import stat

from dpscale.audit.game import write_reports


def test_the_reports_are_owner_only_under_any_umask(tmp_path, umask_022):
    out = tmp_path / "audit"
    write_reports({"rows": []}, [], str(out))
    assert json.loads((out / "audit.json").read_text()) == {"rows": []}
    assert {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in out.iterdir()} == {"audit.json": 0o600, "audit.md": 0o600}
