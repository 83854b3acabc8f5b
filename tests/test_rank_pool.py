"""The rank pool through pure torch DTensor cells on --nproc gloo ranks: pass, raise, hang, crash.

After every failure kind the next ordinary call must pass on a working pool (recovery),
and ordinary calls must reuse the same rank processes (no respawn per test).
"""

from __future__ import annotations

import copy
import re
import uuid

import psutil
import pytest
from keras_dtensor_conformance.rank.outcomes import CRASH, HANG, RAISED, RankFailure

from tests import torch_cells


def assert_pool_works(pool) -> None:
    result = pool.run(torch_cells.whoami)
    assert result.ok, result.story()
    assert [rank for rank, _ in result.values] == list(range(pool.nproc))


def test_sharded_matmul_passes(dist_ranks):
    result = dist_ranks.run(torch_cells.sharded_matmul)
    assert result.ok, result.story()
    values = result.values
    assert [v["rank"] for v in values] == list(range(dist_ranks.nproc))
    assert len({v["pid"] for v in values}) == dist_ranks.nproc
    for v in values:
        assert v["placements"] == ["S(0)"]
        assert v["local_shape"] == (8 // dist_ranks.nproc, 3)
        assert v["max_error"] < 1e-5


def test_ordinary_calls_reuse_the_same_rank_processes(dist_ranks):
    starts = dist_ranks.starts
    first = dist_ranks.run(torch_cells.whoami).values
    second = dist_ranks.run(torch_cells.whoami).values
    assert first == second
    assert [pid for _, pid in first] == dist_ranks.pids
    assert dist_ranks.starts == starts


def test_exception_on_one_rank_fails_with_every_ranks_story(dist_ranks, monkeypatch):
    # Rank 0 is in the barrier long before this grace ends; the pool's own 15 s would only be waited out.
    monkeypatch.setattr(dist_ranks, "error_grace", 5.0)
    result = dist_ranks.run(torch_cells.raise_on_rank, 1)
    assert not result.ok
    bad, waiting = result.outcomes[1], result.outcomes[0]
    assert bad.status == RAISED
    assert bad.error.type == "ValueError"
    assert "deliberate failure on rank 1" in bad.error.message
    assert "raise_on_rank" in bad.error.traceback
    assert "rank 1 says hello on stdout" in bad.stdout
    # Rank 0 waits in a barrier rank 1 never joins: it must not hang the session.
    assert waiting.status == HANG
    assert "after rank 1 failed" in waiting.note
    assert "barrier" in waiting.stack
    story = result.story()
    assert "rank 0" in story and "rank 1" in story and "deliberate failure" in story
    with pytest.raises(RankFailure, match="deliberate failure on rank 1"):
        _ = result.values
    assert_pool_works(dist_ranks)


def test_exception_on_every_rank_keeps_the_pool(dist_ranks):
    """When every rank raised and the group is still in step, the ranks are not restarted."""
    dist_ranks.run(torch_cells.whoami)
    pids = dist_ranks.pids
    result = dist_ranks.run(torch_cells.raise_everywhere)
    assert [o.status for o in result.outcomes] == [RAISED] * dist_ranks.nproc
    assert not result.pool_restarted
    assert dist_ranks.pids == pids
    assert_pool_works(dist_ranks)


def test_hang_dumps_every_rank_and_restarts_the_pool(dist_ranks):
    dist_ranks.run(torch_cells.whoami)
    old_pids = dist_ranks.pids
    result = dist_ranks.run(torch_cells.hang_on_rank, 1, timeout=5)
    assert [o.status for o in result.outcomes] == [HANG] * dist_ranks.nproc
    assert "hang_on_rank" in result.outcomes[1].stack  # the stuck rank's own frame
    assert "barrier" in result.outcomes[0].stack  # the other one, in its collective
    # Both written by the ranks' stack-dump threads (which name the threads), none by faulthandler.
    assert all(o.stack.startswith('Current thread 0x') and '"MainThread"' in o.stack for o in result.outcomes)
    assert "within the 5s timeout" in result.outcomes[1].note
    assert result.pool_restarted
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in old_pids)
    assert_pool_works(dist_ranks)
    assert set(dist_ranks.pids).isdisjoint(old_pids)


def test_a_rank_that_holds_the_gil_is_dumped_by_faulthandler(dist_ranks):
    """The stack-dump thread needs the GIL; a rank stuck in a C call that keeps it still gets its
    stack, from faulthandler's signal handler, and its peer's comes from its own thread."""
    result = dist_ranks.run(torch_cells.hold_gil_on_rank, 1, timeout=5)
    stuck, waiting = result.outcomes[1], result.outcomes[0]
    assert [o.status for o in result.outcomes] == [HANG] * dist_ranks.nproc, result.story()
    assert "hold_gil_on_rank" in stuck.stack and '"MainThread"' not in stuck.stack, stuck.stack
    assert "barrier" in waiting.stack and '"MainThread"' in waiting.stack, waiting.stack
    assert_pool_works(dist_ranks)


@pytest.mark.parametrize(
    "how, exitcode, words",
    [("exit", 3, "exit code 3"), ("segv", -11, "SIGSEGV"), ("kill", -9, "SIGKILL")],
    ids=["os-exit", "segfault", "sigkill"],
)
def test_crash_names_the_rank_and_its_exit(dist_ranks, how, exitcode, words):
    result = dist_ranks.run(torch_cells.crash_on_rank, 1, how)
    dead = result.outcomes[1]
    assert dead.status == CRASH
    assert dead.exitcode == exitcode
    assert words in dead.headline()
    assert "about to die" in dead.stderr
    if how == "segv":
        assert "Segmentation fault" in dead.stderr  # faulthandler's dump of the dying rank
    assert result.outcomes[0].status in (RAISED, HANG)  # its peer vanished mid-collective
    assert result.pool_restarted
    assert_pool_works(dist_ranks)


def test_a_segfault_is_named_before_the_connection_reset_it_caused(dist_ranks):
    """Rank 1 dies while rank 0 sits in an all-reduce; rank 0 then raises "Connection reset by
    peer". The headline must lead with rank 1's crash and its stack, not with rank 0's error."""
    result = dist_ranks.run(torch_cells.segfault_while_peer_in_collective, 1)
    dead, peer = result.outcomes[1], result.outcomes[0]
    assert dead.status == CRASH, result.story()
    assert peer.status == RAISED and peer.lost_peer, result.story()
    assert result.first_failure() is dead
    summary = result.summary()
    assert re.search(
        r"; first failure: rank 1 \(pid \d+\): crashed, killed by signal 11 \(SIGSEGV\) "
        r"in segfault_while_peer_in_collective \(torch_cells\.py:\d+\); then rank 0 \(pid \d+\): raised ",
        summary,
    ), summary
    # The dying rank's story comes first, with faulthandler's stack of the thread that died.
    story = result.story()
    first_story = story[story.index("---------- rank 1") : story.index("---------- rank 0")]
    assert "Fatal Python error: Segmentation fault" in first_story
    assert "SIGSEGV(11), PID:" not in first_story  # torch's native stacks only with --rank-native-stacks
    assert re.search(r"Current thread .*\n.*line \d+ in segfault_while_peer_in_collective", first_story)
    assert result.pool_restarted
    # The controller dates a death when it sees it, which under load can come after the peer's
    # "Connection reset by peer" arrived; that error proves the death came first.
    seen_late = copy.deepcopy(result)
    seen_late.outcomes[1].failed_at = peer.failed_at + 5.0
    assert seen_late.first_failure().rank == 1
    assert_pool_works(dist_ranks)


def test_state_does_not_leak_between_cells(dist_ranks):
    assert dist_ranks.run(torch_cells.leak_state).ok
    seen = dist_ranks.run(torch_cells.observe_state).values
    fresh = dist_ranks.run(torch_cells.observe_state).values
    for state in seen:
        assert state["leaked_env"] is None
        assert state["grad_enabled"] is True
    assert seen == fresh  # the same seeds: the same first random number


def test_process_groups_a_cell_creates_do_not_pile_up(dist_ranks):
    """Each DeviceMesh makes subgroups with threads of their own; the reset between cells frees them."""
    baseline = dist_ranks.run(torch_cells.threads_and_groups).values
    during = [dist_ranks.run(torch_cells.build_2d_mesh).values for _ in range(5)]
    after = dist_ranks.run(torch_cells.threads_and_groups).values
    assert all(groups > 1 for values in during for _, groups in values)  # the cell did make groups
    # Groups return exactly; threads within a slack of 2 for transient ones (a gloo thread winding
    # down). The leak this guards against added 3 threads per mesh: 15 over these five calls.
    assert [g for _, g in during[0]] == [g for _, g in during[-1]]
    assert [g for _, g in after] == [g for _, g in baseline]
    for rank in range(dist_ranks.nproc):
        assert during[-1][rank][0] <= during[0][rank][0] + 2, during
        assert after[rank][0] <= baseline[rank][0] + 2, (after, baseline)


def test_dtensor_caches_do_not_carry_a_mesh_into_the_next_cell(dist_ranks):
    """DTensor's sharding-propagation cache would hand a later cell the earlier cell's mesh, whose
    groups the reset destroyed; the reset clears that cache too."""
    for _ in range(3):
        result = dist_ranks.run(torch_cells.mesh_op_then_collective)
        assert result.ok, result.story()
        assert result.values == [48.0] * dist_ranks.nproc


def test_hung_rank_children_are_killed_with_it(dist_ranks):
    token = uuid.uuid4().hex
    result = dist_ranks.run(torch_cells.spawn_child_and_wait, 60, token, timeout=5)
    assert result.status == HANG
    leftovers = [
        p for p in psutil.process_iter(["cmdline"]) if any(token in part for part in (p.info["cmdline"] or []))
    ]
    assert leftovers == []
    assert_pool_works(dist_ranks)


def test_run_refuses_a_function_the_ranks_cannot_import(dist_ranks):
    def local():
        return 1

    with pytest.raises(TypeError, match="module-level"):
        dist_ranks.run(local)


def test_unpicklable_return_value_is_the_ranks_error(dist_ranks):
    result = dist_ranks.run(torch_cells.return_unpicklable)
    assert result.status == RAISED
    assert "cannot be sent to the controller" in result.outcomes[0].error.message
    assert result.outcomes[0].status == RAISED
    assert_pool_works(dist_ranks)


def test_nccl_ranks_run_the_same_cell(conformance_state):
    gpus = conformance_state.build.cuda_devices
    nproc = conformance_state.nproc
    if gpus < nproc:
        pytest.skip(f"NCCL needs one GPU per rank: --nproc {nproc}, {gpus} GPU(s) visible")
    pool = conformance_state.pool(import_keras=False, backend="nccl")
    result = pool.run(torch_cells.sharded_matmul)
    assert result.ok, result.story()
    assert all(v["max_error"] < 1e-3 for v in result.values)
