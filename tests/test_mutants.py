"""Proof that the suite catches real bugs: each mutant build gets exactly the verdicts it must.

Every mutant (tests/mutants/) is the default build with one bug put back in, run through the
suite with --keras-path on a small tier of cells. The cells the bug reaches must get the named
verdict and every other cell of the tier must still pass: no collateral noise. The unmutated
build passes the same tier, but for its own bugs that a correct rewrite's tier holds
(``mutants.UNMUTATED_FAILS``). ``--mutants-tier default`` runs each mutant on the whole default tier
instead, and reports how many verdicts changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest
from keras_dtensor_conformance.controller.launch import LaunchConfig
from keras_dtensor_conformance.controller.mother import Mother

from tests import mutants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAUGHT: dict[str, bool] = {}
#: mutant name -> its session's JSON report (written by ``mutant_runs``).
REPORTS: dict = {}


#: Mutant sessions run two at a time once the kit's own tests are reached: one session keeps about
#: 1.4 of the 2 cores busy (its ranks wait on each other in collectives, its references on the
#: ranks), so a second fills the rest.
SIDE_BY_SIDE = 2
#: Before that, while the other self-tests run (they leave a core mostly idle: hang and Ctrl-C
#: tests wait, most sessions are one process at a time), one session at a time, from the start.
BESIDE_OTHER_TESTS = 1


class Lanes:
    """How many kit sessions may run at once: ``width``, and none while a test that measures time
    holds ``quiet`` (it waits for the running ones to end first). Sessions enter in their turns
    (the order they were queued in): a lane that has just ended a session does not take the next
    slot ahead of a session that has waited longer. ``close`` lets no waiting session in."""

    def __init__(self, width: int):
        self.width, self.active, self.held, self.turn, self.closed = width, 0, 0, 0, False
        self.changed = threading.Condition()

    @contextlib.contextmanager
    def slot(self, turn: int):
        with self.changed:
            self.changed.wait_for(lambda: self.closed or (
                turn == self.turn and self.held == 0 and self.active < self.width))
            if self.closed:
                raise CancelledError("the kit was closed before this session's turn")
            self.turn += 1
            self.active += 1
            self.changed.notify_all()
        try:
            yield
        finally:
            with self.changed:
                self.active -= 1
                self.changed.notify_all()

    def widen(self, width: int) -> None:
        with self.changed:
            self.width = max(self.width, width)
            self.changed.notify_all()

    @contextlib.contextmanager
    def quiet(self):
        with self.changed:
            self.held += 1
            self.changed.wait_for(lambda: self.active == 0)
        try:
            yield
        finally:
            with self.changed:
                self.held -= 1
                self.changed.notify_all()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


def selected_sessions(items) -> list[tuple[str, mutants.Case | None, int]]:
    """The kit sessions the selected tests wait for, in the tests' order: the unmutated build's tier
    per rank count (``unmutated-nprocN``), then each mutant's."""
    selected = []
    for item in items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if getattr(item, "originalname", None) == "test_unmutated_build_passes_the_mutant_tier":
            selected.append((f"unmutated-nproc{params['nproc']}", None, params["nproc"]))
        elif getattr(item, "originalname", None) == "test_mutant_gets_exactly_its_verdicts":
            selected.append((params["case"].mutant.name, params["case"], params["case"].nproc))
    return selected


class Kit:
    """The selected kit sessions, queued at the session's start (``tests/conftest.mutant_kit``) in
    ``Lanes``: one beside the other self-tests, ``SIDE_BY_SIDE`` once the kit's own tests run (they
    come after the others), none while a test that measures time runs (those come last), each with
    ``runner`` (``run_suite``) in the environment the kit started in. ``futures``: session name ->
    its verdict per cell. Each lane has its own pytest cache folder (a cache is not written by two
    sessions at once), all of them in one place: what a lane's sessions share is the JAX
    reference's XLA executables (``conformance/conftest.JAX_CACHE``), keyed by the lowered program,
    so a mutant of JAX-side code compiles its own and the others load what an earlier session
    compiled."""

    def __init__(self, selected, keras_tree: str, tmp_path_factory, tier_of, runner=None):
        self.lanes = Lanes(BESIDE_OTHER_TESTS)
        # The environment as the session started: a test beside a kit session may change the
        # process's own (``monkeypatch.setenv("TMPDIR", ...)``), which a session started then would take.
        env = session_env()
        launch = runner or run_suite  # a test gives its own
        #: mutant name -> its build's folder.
        self.builds: dict[str, str] = {}
        shared_cache = tmp_path_factory.mktemp("mutant-sessions-cache")
        caches: dict[str, str] = {}

        def run(turn: int, name: str, case: mutants.Case | None, nproc: int) -> dict[str, str]:
            with self.lanes.slot(turn):
                out = tmp_path_factory.mktemp(name)
                cache = caches.setdefault(threading.current_thread().name,
                                          os.path.join(shared_cache, threading.current_thread().name))
                if case is None:
                    return launch(keras_tree, mutants.unmutated_tier(nproc), out, cache_dir=cache, nproc=nproc,
                                  full=mutants.unmutated_needs_full(nproc), env=env)
                build = self.builds[name] = mutants.write_mutant(keras_tree, str(out / case.mutant.name), case.mutant)
                verdicts = launch(build, tier_of(case), out, case.rank_timeout, cache_dir=cache,
                                  nproc=case.nproc, full=case.full, env=env)
                REPORTS[case.mutant.name] = out / "report.json"
                return verdicts

        self.pool = ThreadPoolExecutor(SIDE_BY_SIDE, thread_name_prefix="mutant-lane")
        self.futures = {name: self.pool.submit(run, turn, name, case, nproc)
                        for turn, (name, case, nproc) in enumerate(selected)}

    def close(self) -> None:
        """Start no other session (the lanes may still be shut: a run that ends before the kit's
        tests); wait for the running ones."""
        for future in self.futures.values():
            future.cancel()
        self.lanes.close()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def mutant_runs(mutant_kit):
    """The kit's sessions (``Kit.futures``), two at a time from here on; each test waits for its
    own verdicts and judges them. None selected (``-k every_promise`` alone): none."""
    if mutant_kit is None:
        return {}
    mutant_kit.lanes.widen(SIDE_BY_SIDE)
    return mutant_kit.futures


_mother: Mother | None = None
_mother_lock = threading.Lock()


def mother() -> Mother:
    """The self-tests' mother zygote, started at first use and closed at the end of the session
    (``tests/conftest``): each inner session started with ``session_env`` has its zygote forked
    there, its imports done, instead of importing torch and the rest again. Not for a session
    whose leftover processes are found by their environment (``tests/conftest.InnerSession``): a
    forked zygote's shows the mother's."""
    global _mother
    with _mother_lock:
        if _mother is None:
            workdir = tempfile.mkdtemp(prefix="kdc-m-")
            _mother = Mother(LaunchConfig(None, os.path.join(workdir, "keras-home")).base_env(), workdir)
            _mother.start()
        return _mother


def close_mother() -> None:
    global _mother
    with _mother_lock:
        if _mother is not None:
            _mother.close()
            _mother = None


def session_env(own_zygote: bool = False) -> dict[str, str]:
    """This process's environment for an inner session: the outer session's options not passed
    on, and the mother zygote's address (``mother``) but for a session that starts its own."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return env if own_zygote else dict(env, **mother().env())


def run_suite(keras_path: str, cells, out, rank_timeout: int = 300, cache_dir: str | None = None,
              nproc: int = 2, full: bool = False, env: dict[str, str] | None = None) -> dict[str, str]:
    """Run ``cells`` against the build at ``keras_path`` with ``nproc`` ranks (``--full``'s cells when
    ``full``) in ``env`` (None: this process's, as ``session_env`` gives it); return verdict per cell name."""
    report = str(out / "report.json")
    cache = ["-o", f"cache_dir={cache_dir}"] if cache_dir else ["-p", "no:cacheprovider"]
    cmd = [sys.executable, "-m", "pytest", *cache, "-q", f"--keras-path={keras_path}", "--nproc", str(nproc),
           "--rank-timeout", str(rank_timeout), "--conformance-json", report, *(["--full"] if full else []), *cells]
    proc = subprocess.run(cmd, cwd=ROOT, env=session_env() if env is None else env, capture_output=True, text=True,
                          timeout=1800)
    assert os.path.exists(report), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(report) as f:
        return {c["id"]: c["verdict"] or "skipped" for c in json.load(f)["cells"]}


def tier(config: pytest.Config, case: mutants.Case):
    if config.getoption("mutants_tier") == "default":
        return ["conformance"]
    return list(case.tier)


@pytest.mark.parametrize("nproc", mutants.KIT_NPROCS, ids=[f"nproc{n}" for n in mutants.KIT_NPROCS])
def test_unmutated_build_passes_the_mutant_tier(nproc, mutant_runs):
    tier = mutants.unmutated_tier(nproc)
    verdicts = mutant_runs[f"unmutated-nproc{nproc}"].result()
    assert len(verdicts) == len(tier)
    assert {c: v for c, v in verdicts.items() if v != "pass"} == mutants.unmutated_fails(nproc)


@pytest.mark.parametrize("case", mutants.CASES, ids=[c.mutant.name for c in mutants.CASES])
def test_mutant_gets_exactly_its_verdicts(case, mutant_runs, request):
    verdicts = mutant_runs[case.mutant.name].result()
    if case.expected:  # a correct rewrite (nothing expected to change) is no mutant to catch
        CAUGHT[case.mutant.name] = all(verdicts.get(cell) == v for cell, v in case.expected.items())
    for cell, want in case.expected.items():
        assert verdicts.get(cell) == want, f"{case.mutant.name} ({case.mutant.imitates}): {cell}"
    if request.config.getoption("mutants_tier") != "default":
        collateral = {c: v for c, v in verdicts.items() if c not in case.expected and v != "pass"}
        assert collateral == {}, f"{case.mutant.name} changed cells it should not reach"
        assert len(verdicts) == len(case.tier)
    else:
        changed = sum(v != "pass" for v in verdicts.values())
        print(f"{case.mutant.name}: {changed} of {len(verdicts)} default-tier cells do not pass")


def test_a_jax_reference_that_raises_is_not_judged_and_counted(mutant_runs):
    """The JAX backend of ``jax-optimizer-raises`` raises on every fit: each cell still passes on its
    torch checks, its jax-numbers and jax-layouts are "not judged" with the reason (never "not
    applicable"), and the report counts them once per run and in the promise they touch."""
    name = "jax-optimizer-raises"
    if name not in mutant_runs:
        pytest.skip(f"needs {name}'s session: run its test_mutant_gets_exactly_its_verdicts too")
    verdicts = mutant_runs[name].result()
    assert set(verdicts.values()) == {"pass"}
    with open(REPORTS[name]) as f:
        report = json.load(f)
    cells = [c for c in report["cells"] if c.get("checks")]
    assert len(cells) == len(verdicts)
    for cell in cells:
        for check in ("jax-numbers", "jax-layouts"):
            outcome = cell["checks"][check]
            assert outcome["outcome"] == "not judged" and "mutant: the JAX backend's optimizer" in outcome["why"]
    assert {(n["check"], n["cells"]) for n in report["not_judged"]} == {("jax-numbers", len(verdicts)),
                                                                        ("jax-layouts", len(verdicts))}
    jax_promise = next(p for p in report["promises"] if p["name"] == "agrees-with-jax-backend")
    assert jax_promise["not_judged"] == len(verdicts) and jax_promise["status"] == "not judged"


def test_every_promise_and_every_check_is_broken_by_a_mutant(mutant_runs, request):
    """No unfalsifiable claim: each promise the suite reports is BROKEN in some mutant's report,
    and each check that can say "held" failed in some mutant's cells (the evidence the promise
    counts). A promise or check no mutant of the kit breaks fails here: add the mutant."""
    from conformance.judge.fit_checks import CHECKS
    from conformance.judge.hub import CHECKS as HUB_CHECKS
    from conformance.judge.op_checks import OP_CHECKS
    from conformance.promises import PROMISES

    names = {case.mutant.name for case in mutants.CASES}
    if not names <= set(mutant_runs):
        pytest.skip("needs every mutant's session: run tests/test_mutants.py whole")
    broken: dict[str, list[str]] = {p.name: [] for p in PROMISES}
    failed: dict[str, list[str]] = {name: [] for name in (*CHECKS, *OP_CHECKS, *HUB_CHECKS)}
    for name in sorted(names):  # the mutants' reports, not the unmutated build's
        mutant_runs[name].result()
        with open(REPORTS[name]) as f:
            report = json.load(f)
        for promise in report["promises"]:
            if promise["status"] == "broken":
                broken.setdefault(promise["name"], []).append(name)
        for cell in report["cells"]:
            for check, outcome in (cell.get("checks") or {}).items():
                if outcome["outcome"] == "failed":
                    failed.setdefault(check, []).append(name)
    assert [p for p, names in broken.items() if not names] == [], "promises no mutant breaks"
    assert [c for c, names in failed.items() if not names] == [], "checks no mutant fails"


def test_the_kit_sessions_zygotes_are_forked_by_the_mother(mutant_kit, mutant_runs):
    """Each mutant's session had its zygote forked by the self-tests' (``mother``), imports done:
    one refused (another interpreter start-up) or never asked would import everything again."""
    names = {case.mutant.name for case in mutants.CASES} & set(mutant_runs)
    if not names:
        pytest.skip("no mutant's session selected")
    for name in names:
        mutant_runs[name].result()
    served = {env.get("KDC_KERAS_PATH") for env in mother().served}
    assert set(mutant_kit.builds) == names
    assert [name for name, build in mutant_kit.builds.items() if build not in served] == []


def mutation_score() -> str | None:
    if not CAUGHT:
        return None
    return f"mutation score: {sum(CAUGHT.values())}/{len(CAUGHT)} mutants caught with the right verdict"


def test_a_mutant_tree_runs_its_patch_not_the_source_trees_bytecode(tmp_path):
    """write_mutant hard-links the source tree's bytecode (so no process compiles all of Keras
    again) and drops the patched module's, whose stale bytecode would otherwise run the original:
    with PYTHONDONTWRITEBYTECODE set, nothing rewrites it."""
    import compileall

    source = tmp_path / "source"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "__init__.py").write_text("")
    (source / "pkg" / "mod.py").write_text("VALUE = 'original'\n")
    (source / "pkg" / "other.py").write_text("VALUE = 'untouched'\n")
    compileall.compile_dir(str(source), quiet=2)
    mutant = mutants.Mutant(name="m", imitates="a test",
                            patches=(mutants.Patch("pkg/mod.py", "'original'", "'patched!'"),))
    dest = mutants.write_mutant(str(source), str(tmp_path / "dest"), mutant)
    # The same size and mtime as the source: a stale .pyc would pass Python's own check and run.
    stat = os.stat(source / "pkg" / "mod.py")
    os.utime(os.path.join(dest, "pkg", "mod.py"), ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.exists(os.path.join(dest, "pkg", "__pycache__")) and not any(
        name.startswith("mod.") for name in os.listdir(os.path.join(dest, "pkg", "__pycache__")))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": dest}
    out = subprocess.run([sys.executable, "-c", "import pkg.mod, pkg.other; print(pkg.mod.VALUE, pkg.other.VALUE)"],
                         env=env, capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert out == ["patched!", "untouched"]
    assert open(source / "pkg" / "mod.py").read() == "VALUE = 'original'\n"  # the hard link was broken


def test_lanes_hold_new_sessions_while_a_test_measures_time():
    """``quiet`` waits for the running session, and no session starts until it is over; ``width``
    sessions at most run at once, and widening lets a waiting one in."""
    lanes, events = Lanes(1), []
    first_in, release_first, quiet_in, release_quiet = (threading.Event() for _ in range(4))

    def session(turn: int, name: str, hold: threading.Event | None = None):
        with lanes.slot(turn):
            events.append(f"{name} starts")
            if hold is not None:
                first_in.set()
                hold.wait(10)
            events.append(f"{name} ends")

    def measure():
        with lanes.quiet():
            quiet_in.set()
            events.append("measured")
            release_quiet.wait(10)

    runner = ThreadPoolExecutor(3)
    first = runner.submit(session, 0, "first", release_first)
    assert first_in.wait(10)
    second = runner.submit(session, 1, "second")  # waits: one lane
    measuring = runner.submit(measure)
    while lanes.held == 0:
        time.sleep(0.01)
    assert not quiet_in.wait(0.2)  # the first session still runs
    release_first.set()
    assert quiet_in.wait(10)
    time.sleep(0.2)  # the lane is free now: only quiet keeps the second session out
    assert events == ["first starts", "first ends", "measured"]
    release_quiet.set()
    for done in (first, second, measuring):
        done.result(10)
    assert events[3:] == ["second starts", "second ends"]
    assert (lanes.active, lanes.held) == (0, 0)
    lanes.widen(2)
    with lanes.slot(2), lanes.slot(3):  # two at once, without waiting
        assert lanes.active == 2
    runner.shutdown()


def test_lanes_let_sessions_in_in_their_turns_and_none_once_closed():
    """The thread that ends a session and asks again does not go ahead of one that waited (it did:
    the kit's longest session then waited out the other tests and ran last); a session still
    waiting when the kit closes never starts."""
    lanes, order = Lanes(1), []

    def session(turn: int):
        with lanes.slot(turn):
            order.append(turn)

    runner = ThreadPoolExecutor(3)
    waiting = [runner.submit(session, turn) for turn in (2, 1)]  # asked before turn 0's
    time.sleep(0.1)
    assert order == []
    session(0)  # in this thread, which then asks at once for a later turn
    session(3)
    assert [f.result(10) for f in waiting] == [None, None]
    assert order == [0, 1, 2, 3]
    shut = Lanes(0)
    left_out = runner.submit(lambda: shut.slot(0).__enter__())
    time.sleep(0.1)
    shut.close()
    with pytest.raises(CancelledError):
        left_out.result(10)
    runner.shutdown(wait=False)


def test_a_kit_session_takes_the_environment_the_kit_started_in(monkeypatch, tmp_path_factory, tmp_path):
    """Not the one a test beside it has set meanwhile: a test's TMPDIR once took a kit session's
    private folders, and that test then found them left behind."""
    seen = {}

    def fake_run_suite(keras_path, cells, out, *args, env=None, **kwargs):
        seen.update(env)
        return {}

    monkeypatch.delenv("KDC_TEST_BESIDE", raising=False)
    kit = Kit([("unmutated-nproc2", None, 2)], str(tmp_path), tmp_path_factory, lambda case: [], runner=fake_run_suite)
    try:
        monkeypatch.setenv("KDC_TEST_BESIDE", "set by a test while the kit waits")
        kit.lanes.widen(1)
        assert kit.futures["unmutated-nproc2"].result(30) == {}
    finally:
        kit.close()
    assert seen and "KDC_TEST_BESIDE" not in seen and "PYTEST_ADDOPTS" not in seen
