"""Under torchrun the plugin uses the launcher's process group instead of spawning ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_mutants import session_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_suite_runs_in_a_torchrun_group():
    env = session_env()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--local-ranks-filter", "0",
        "-m", "pytest", "-p", "no:cacheprovider", "tests/under_torchrun", "-q",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "4 passed" in output
