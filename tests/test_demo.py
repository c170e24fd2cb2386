"""`make demo` end to end: four kernels load offline and match their references."""

import subprocess
import sys

from tools.common import REPO_ROOT


def test_demo_prints_four_matching_rows():
    out = subprocess.run([sys.executable, "-m", "tools.demo"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("tessera/")]
    assert [r.split()[0] for r in rows] == ["tessera/ldsa", "tessera/log-mel", "tessera/based-bwd", "tessera/comba-bwd"]
    assert all(" yes " in r for r in rows)
