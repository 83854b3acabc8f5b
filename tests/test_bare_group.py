"""The bare group (``controller/bare_group.py``): processes started as torchrun starts a script.

Each process gets torchrun's variables and nothing of the harness; its outcome is a rank's: a value,
an exception with its chain, a death with its exit, a hang with every thread's stack. None of them
outlives the call.
"""

from __future__ import annotations

import os

import psutil
from keras_dtensor_conformance.controller.bare_group import BareGroup
from keras_dtensor_conformance.controller.launch import LaunchConfig
from keras_dtensor_conformance.rank.outcomes import CRASH, HANG, OK, RAISED

from tests import bare_calls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def group(tmp_path, timeout: float = 60.0) -> BareGroup:
    return BareGroup(LaunchConfig(keras_path=None, keras_home=str(tmp_path)), 2, "gloo", timeout, [ROOT])


def gone(pids) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def test_each_process_gets_torchruns_variables_and_returns_its_value(tmp_path):
    result = group(tmp_path).run(bare_calls.environment, "hello")
    assert result.ok
    assert [(v["tag"], v["RANK"], v["LOCAL_RANK"], v["WORLD_SIZE"], v["MASTER_ADDR"]) for v in result.values] == [
        ("hello", "0", "0", "2", "127.0.0.1"), ("hello", "1", "1", "2", "127.0.0.1")]
    assert gone(o.pid for o in result.outcomes)


def test_a_raising_process_is_raised_with_its_exception(tmp_path):
    result = group(tmp_path).run(bare_calls.raises)
    assert [o.status for o in result.outcomes] == [RAISED, RAISED]
    assert result.outcomes[1].error.type == "ValueError" and "rank 1 refuses" in result.outcomes[1].error.message


def test_a_dead_process_is_a_crash_with_its_exit_and_the_others_keep_their_value(tmp_path):
    result = group(tmp_path).run(bare_calls.dies_on_rank_one)
    assert [o.status for o in result.outcomes] == [OK, CRASH]
    assert "exit code 3" in result.outcomes[1].note


def test_a_hung_process_is_a_hang_with_its_stack_and_is_gone_after_the_call(tmp_path):
    result = group(tmp_path, timeout=5.0).run(bare_calls.hangs_on_rank_one)
    assert [o.status for o in result.outcomes] == [OK, HANG]
    assert "hangs_on_rank_one" in result.outcomes[1].stack  # faulthandler's dump of every thread
    assert gone(o.pid for o in result.outcomes)
