"""A plugin for the self-tests that read a session's selection (tests/test_slicing.py,
tests/test_figures.py): writes every selected item's node id and slicing family, in collection
order, to the file $KDC_SLICE_DUMP (after -k, -m and any --conformance-slice); ``collected`` runs
such a session and reads it."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from keras_dtensor_conformance.slicing.estimate import family_key


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    with open(os.environ["KDC_SLICE_DUMP"], "w") as f:
        json.dump([[item.nodeid, family_key(item)] for item in session.items], f)


def collected(tmp_path: pathlib.Path, *args: str) -> list[list[str]]:
    """(nodeid, family) of what a session with ``args`` selects, from its collection alone."""
    out = tmp_path / f"dump-{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                           "-p", "tests.slice_dump", *args], cwd=pathlib.Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, env={**os.environ, "KDC_SLICE_DUMP": str(out)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())
