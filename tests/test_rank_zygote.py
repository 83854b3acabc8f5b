"""A pool's own zygote (``controller/rank_zygote.py``): it imports the build and takes a rank's
baseline once, its ranks and their replacements are forked from it ready, and it serves only a rank
whose environment gives every variable the build's import read the same value. That the verdicts of
ranks forked from it are those of fresh ranks is ``tests/test_fresh_verdicts.py``'s."""

from __future__ import annotations

import os
import sys
import types

import pytest
from keras_dtensor_conformance.controller.zygote import Zygote
from keras_dtensor_conformance.rank import isolation, worker
from keras_dtensor_conformance.rank.zygote import reads_of_environ

from tests import torch_cells
from tests.own_imports import alone, imports_another_package, reads_environment


def test_every_way_of_reading_the_environment_is_recorded(monkeypatch):
    monkeypatch.setenv("KDC_TEST_SET", "1")
    monkeypatch.delenv("KDC_TEST_UNSET", raising=False)
    with reads_of_environ() as read:
        assert os.environ["KDC_TEST_SET"] == "1"
        assert os.getenv("KDC_TEST_UNSET") is None
        assert "KDC_TEST_CONTAINS" not in os.environ
        os.environ.get("KDC_TEST_GET", "default")
    assert read == {"KDC_TEST_SET": "1", "KDC_TEST_UNSET": None, "KDC_TEST_CONTAINS": None, "KDC_TEST_GET": None}
    assert type(os.environ).__name__ == "_Environ"  # put back
    with reads_of_environ() as read:
        dict(os.environ)
    assert read == dict(os.environ)  # iterating reads everything


def test_it_serves_only_a_rank_whose_environment_gives_the_import_the_same_values(tmp_path):
    env = {"PYTHONPATH": "/build", "KERAS_HOME": "/home/k", "RANK": "0"}
    zygote = Zygote(env, str(tmp_path / "z"), parent=Zygote({}, str(tmp_path / "p")))
    zygote.info = {"build": {"environ": {"KERAS_HOME": "/home/k", "KERAS_BACKEND": None}}}
    assert zygote.compatible(dict(env, RANK="1"))  # a variable the import did not read
    assert not zygote.compatible(dict(env, KERAS_HOME="/elsewhere"))
    assert not zygote.compatible(dict(env, KERAS_BACKEND="jax"))  # unset when the import read it
    assert not zygote.compatible(dict(env, PYTHONPATH="/another-build"))


@pytest.fixture
def rank_zygote(keras_ranks):
    keras_ranks.run(torch_cells.whoami)  # started
    zygote = keras_ranks.rank_zygote
    if zygote is None:
        pytest.skip("no pool zygote here: none (no session zygote)")
    if not zygote.serving:
        # On Linux a zygote that does not serve is a defect, not a platform's limit: every rank then imports
        # torch and the build itself (a thread a warm import left, once, made CI's order self-test 5x longer).
        (pytest.fail if sys.platform.startswith("linux") else pytest.skip)(f"the pool's zygote does not serve: "
                                                                          f"{zygote.why_not}")
    return zygote


def test_the_ranks_and_their_replacements_are_forked_ready_from_the_pools_zygote(keras_ranks, rank_zygote):
    first = keras_ranks.run(torch_cells.forked_ready).values
    keras_ranks.kill("a test's replacement")
    again = keras_ranks.run(torch_cells.forked_ready).values
    for values in (first, again):
        assert [v["inherited"] for v in values] == [True] * keras_ranks.nproc
        assert {v["ppid"] for v in values} == {rank_zygote.info["pid"]}
    assert {v["pid"] for v in first}.isdisjoint(v["pid"] for v in again)
    assert keras_ranks.rank_zygote is rank_zygote  # the same zygote served the replacement
    # What the build's import read: the backend, so another backend's ranks are not served.
    assert "KERAS_BACKEND" in rank_zygote.info["build"]["environ"]


def test_a_module_a_ranks_call_imported_alone_is_imported_by_the_pools_zygote_for_the_ranks_after(keras_ranks,
                                                                                                rank_zygote):
    """A rank whose call imported the call's module says so when that import imported only modules of its
    own package and read no environment variable; its pool's zygote imports it, and the ranks forked after
    find it imported, as they find the build. One that read the environment (it may differ by rank) or
    imported another package's modules (in the zygote, after its baseline) is left to each rank."""
    reads, other = reads_environment, imports_another_package
    names = [module.__name__ for module in (alone, reads, other)]
    keras_ranks.kill("a test's replacement")
    assert keras_ranks.run(torch_cells.imported, names).values == [dict.fromkeys(names, False)] * keras_ranks.nproc
    for module, said in ((alone, alone.__name__), (reads, None), (other, None)):
        assert [o.own_import for o in keras_ranks.run(module.pid).outcomes] == [said] * keras_ranks.nproc
    keras_ranks.kill("a test's replacement")
    after = {alone.__name__: True, reads.__name__: False, other.__name__: False}
    assert keras_ranks.run(torch_cells.imported, names).values == [after] * keras_ranks.nproc


def test_a_calls_module_in_a_package_imported_at_the_baseline_is_left_to_each_rank(monkeypatch):
    """Its package is the build's, torch's or another the zygote holds: imported there after the baseline,
    it would be a module of that package the baseline lacks. The same import passes where the package was
    not imported at the baseline."""
    for at_baseline, said in ((frozenset(), alone.__name__), (frozenset({"tests"}), None)):
        monkeypatch.setattr(isolation, "_BASELINE", types.SimpleNamespace(module_names=at_baseline))
        monkeypatch.delitem(sys.modules, alone.__name__)  # imported again by the call, as a fresh rank's
        function, own_import = worker.resolve(alone.__name__, "pid")
        assert function() == os.getpid() and own_import == said


TRACED = '''
def traced(x):
    return x.sin() + 1
'''


def test_the_files_a_ranks_trace_read_are_read_by_the_pools_zygote_for_the_ranks_after(keras_ranks, rank_zygote,
                                                                                     tmp_path):
    """A rank says which source files its traces read whole (dynamo names the functions of a trace's
    lines by tokenizing their file, once per process); its pool's zygote reads them, so the ranks
    forked after find them read, as they would after their own first trace."""
    path = str(tmp_path / "traced_here.py")
    with open(path, "w") as f:
        f.write(TRACED)
    keras_ranks.kill("a test's replacement")
    first = keras_ranks.run(torch_cells.trace_file, path)
    assert first.values == [{"read_before": False, "read_after": True}] * keras_ranks.nproc
    assert all(path in o.source_names for o in first.outcomes)
    keras_ranks.kill("a test's replacement")
    again = keras_ranks.run(torch_cells.source_names_as_read, path)
    assert again.values == [{"read": True, "same": True}] * keras_ranks.nproc
