"""The references of training cells, cached per reference configuration.

Three judge a training cell's numbers (README, "Three references"): the single-process torch
reference (below: a distribution bug), the same build's JAX backend under the same distribution
(``JaxReferences``: a torch-backend bug that single-process and distributed torch share; its
layouts are held to the LayoutMap, as torch's are), and the NumPy oracle for its core set
(``judge/oracle.py``: a bug every backend shares).

By default the reference runs on the build under test. ``--reference-keras-path`` runs it on
another build (a release, say), so a maths bug of the build under test that its single-process
and distributed runs share shows as a difference; a cell whose API that other build lacks falls
back to the same build, and the cell's record says which reference it used.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import importlib.util
import json
import re

import numpy as np

from conformance.cell_data import policy
from conformance.judge import fit_checks
from conformance.ranks import jax_reference as rank_jax
from conformance.ranks import train as rank_train

SAME_BUILD = "same build"

#: Exceptions (type suffix, message pattern) by which a build says it lacks a cell's API: the
#: reference then falls back to the build under test. Any other failure is the reference's own.
MISSING_API = (
    ("NotInBuild", ""),
    ("AttributeError", r"has no attribute"),
    ("TypeError", r"unexpected keyword argument"),
)


@dataclasses.dataclass(frozen=True)
class Reference:
    """A reference's PoolResult and which build computed it (the cell record's ``reference``)."""

    result: object
    source: str


@dataclasses.dataclass(frozen=True)
class OtherBuild:
    """The pool of ``--reference-keras-path`` and how records name it (``keras 3.15.1 at PATH``)."""

    pool: object
    label: str


def missing_api(result) -> str | None:
    """Why the build that ran ``result`` lacks the cell's API, or None when that is not the failure."""
    for outcome in result.outcomes:
        error = outcome.error
        if error is None:
            continue
        for type_suffix, pattern in MISSING_API:
            if error.type.endswith(type_suffix) and re.search(pattern, error.message):
                return f"{error.type.rpartition('.')[2]}: {error.message}"
    return None


class References:
    """Single-process results, computed once per reference configuration in a clean process.

    The reference runs the same model, seed, data source (so the same order) and optimizer with no
    distribution and no torch.compile; cells that differ only in layout or in whether they compile
    share one reference.
    """

    def __init__(self, pool, other: OtherBuild | None = None):
        self.pool = pool
        self.other = other
        self._cache: dict[str, Reference] = {}
        self._runs: dict[str, object] = {}

    @staticmethod
    def spec_for(spec: dict) -> dict:
        return fit_checks.reference_spec(spec)

    def get(self, spec: dict):
        """The reference's PoolResult for ``spec`` (cached: failures too, they do not change)."""
        return self.lookup(spec).result

    def lookup(self, spec: dict) -> Reference:
        """The reference of ``spec`` and which build computed it (cached)."""
        ref = self.spec_for(spec)
        key = json.dumps(ref, sort_keys=True)
        if key not in self._cache:
            self._cache[key] = self._compute(ref)
        return self._cache[key]

    def single_process(self, fn, spec: dict):
        """The same build's single-process run of rank function ``fn(spec, distributed=False)`` for
        ``spec`` without layout, eager: its PoolResult, cached (failures too), so cells that differ
        only in layout or compile mode share one (the agreement and on-batch cells)."""
        ref = dict(spec, layout={"kind": "single"}, layout_name="single", compile="nojit")
        key = json.dumps([fn.__module__, fn.__qualname__, ref], sort_keys=True)
        if key not in self._runs:
            self._runs[key] = self.pool.run(fn, ref, False)
        return self._runs[key]

    def _compute(self, ref: dict) -> Reference:
        if self.other is None:
            return Reference(self.pool.run(rank_train.train, ref, False), SAME_BUILD)
        result = self.other.pool.run(rank_train.train, ref, False)
        reason = missing_api(result)
        if reason is None:
            return Reference(result, self.other.label)
        fallback = f"{SAME_BUILD} (fallback: {self.other.label} lacks it: {reason})"
        return Reference(self.pool.run(rank_train.train, ref, False), fallback)


#: Why no JAX reference ran, when JAX is not installed (the report header says it once).
NO_JAX = "JAX is not installed (pip install 'keras-dtensor-conformance[jax]')"


def jax_installed() -> bool:
    return importlib.util.find_spec("jax") is not None


@dataclasses.dataclass(frozen=True)
class JaxReference:
    """A cell's JAX reference: its evidence (``jax_reference.train``'s dict), or None and why not."""

    evidence: dict | None
    note: str  #: the cell record's ``references["jax"]``: "judged: ..." or "not run: why"
    #: Why the run raised, crashed or hung (its check is then "not judged", not "not applicable").
    failure: str | None = None


def jax_key(spec: dict, initial_weights: dict, nproc: int | None) -> str:
    """What a JAX reference's numbers depend on: the model, optimizer, the data as fed (plain,
    sample weights, dict inputs or a PyDataset, which orders its batches itself: every other source
    yields the arrays' batches in order), the initial weights and the dtype policy; not the torch compile mode or data
    source, nor steps_per_execution (the JAX run reports every step's running loss, and a ``spe4``
    cell is compared with the steps it reports: ``jax_compare.reported_steps``). With ``nproc``, the
    key of its layouts: the layout's kind, mesh and map and the ranks' count too."""
    digest = hashlib.sha256()
    for path in sorted(initial_weights):
        digest.update(path.encode())
        digest.update(np.ascontiguousarray(initial_weights[path]).tobytes())
    data = spec["data"] if spec["data"] in ("sample-weights", "dict", "pydataset", "pydataset-workers") else "plain"
    layout = None if nproc is None else [spec["layout"], nproc]
    return json.dumps([spec["model"], spec["optimizer"], data, layout, digest.hexdigest(), policy(spec),
                       spec.get("seed", 0)], sort_keys=True)


#: The JAX reference's steps XLA-compiled. Measured here (one XLA thread, 2 virtual devices):
#: eager JAX compiles each op once per shape and sharding, 6-7.7 s for the attention model's first
#: fit on a layout and 1.8-2.9 s for a new layout of the MLP, against 0.5-1.7 s compiled; and a new
#: optimizer's sharded update ops cost about as much eager as compiled: the 26 optimizers' first
#: cells of the default tier took 21.2 s more than before the JAX reference with every fit but the
#: first eager, 16.8 s with every fit compiled (docs/measurements.md). Numbers agree either way.
JIT = True


def _mesh(evidence: dict) -> str:
    return "x".join(str(n) for n in evidence["mesh_shape"]) or "no"


class JaxReferences:
    """The same build's JAX backend run on each cell's data from the ranks' initial weights, under
    the cell's distribution on virtual CPU devices.

    The numbers are cached per ``jax_key`` without the layout (one fitted run serves every compile
    mode, data source and layout of a model, optimizer and data: JAX computes the same model under
    every distribution, within the tolerances), the layouts per ``jax_key`` with it: the fitted run's
    own, or for another layout a run that only builds the model and its optimizer's variables under
    that distribution (``jax_reference.train(fit=False)``: no XLA compile of a train step)."""

    def __init__(self, pool, nproc: int):
        self.pool = pool  # None: JAX is not installed
        self.nproc = nproc
        # Touched by the executor's one thread only, which alone calls the pool.
        self._numbers: dict[str, JaxReference] = {}
        self._layouts: dict[str, JaxReference] = {}
        #: Per model built, the initial weights the ranks of its last cell reported (the caller's thread).
        self._last_initial: dict[str, dict] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdc-jax-reference")
        self._ahead: list[concurrent.futures.Future] = []

    def prefetch(self, spec: dict) -> None:
        """Start ``spec``'s JAX reference before its ranks run, while they run, from the initial
        weights the ranks of the last cell of the same model started from: every cell of a model
        starts from the same seed, so this is the reference the cell will ask for (the numbers'
        key holds the weights' hash: when the ranks report other weights, ``submit`` computes
        theirs, and the early run only cost its time). The JAX process would otherwise wait for
        the ranks, and the ranks for it."""
        initial = self._last_initial.get(rank_train.model_name(spec))
        if self.pool is not None and initial is not None:
            self._ahead.append(self._executor.submit(self._get, spec, initial))

    def submit(self, spec: dict, values: list[dict]) -> concurrent.futures.Future:
        """``spec``'s JaxReference, from the ranks' initial weights, computed in the executor's thread."""
        initial = values[0]["initial_weights"]
        self._last_initial[rank_train.model_name(spec)] = initial
        return self._executor.submit(self._get, spec, initial)

    def result(self, pending: concurrent.futures.Future) -> JaxReference:
        """What ``submit`` returned, once computed; an early run's exception is raised here too."""
        reference = pending.result()
        ahead, self._ahead = self._ahead, []
        for early in ahead:  # done: the executor ran them before ``pending``
            early.result()
        return reference

    def get(self, spec: dict, values: list[dict]) -> JaxReference:
        return self.result(self.submit(spec, values))

    def close(self) -> None:
        """Cancel what has not started; a run in flight ends when the session closes its pool."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _get(self, spec: dict, initial: dict) -> JaxReference:
        if self.pool is None:
            return JaxReference(None, f"not run: {NO_JAX}")
        numbers_key, layouts_key = jax_key(spec, initial, None), jax_key(spec, initial, self.nproc)
        if numbers_key not in self._numbers:
            numbers = self._numbers[numbers_key] = self._run(spec, initial, True)
            if numbers.evidence is not None:
                self._layouts[layouts_key] = numbers
        numbers = self._numbers[numbers_key]
        if numbers.evidence is None:
            return numbers
        if layouts_key not in self._layouts:
            self._layouts[layouts_key] = self._run(spec, initial, False)
        layouts = self._layouts[layouts_key]
        if layouts.evidence is None:
            return layouts
        if layouts is numbers:
            return numbers
        evidence = {**numbers.evidence, **{k: layouts.evidence[k] for k in rank_jax.LAYOUT_KEYS}}
        return JaxReference(evidence, f"judged: keras' JAX backend (jax {evidence['jax_version']}; numbers "
                                      f"fitted on a {_mesh(numbers.evidence)} mesh, layouts built on a "
                                      f"{_mesh(evidence)} mesh of virtual CPU devices)")

    def _run(self, spec: dict, initial: dict, fit: bool) -> JaxReference:
        result = self.pool.run(rank_jax.train, spec, initial, self.nproc, JIT, fit)
        if not result.ok:
            error = next((o.error for o in result.outcomes if o.error is not None), None)
            why = f"{error.type.rpartition('.')[2]}: {error.message}" if error is not None else result.story()
            note = f"not run: this build's JAX backend could not run the cell ({why})"
            # The cell's models differ between backends: nothing to compare, not a failed reference.
            comparable = error is not None and error.type.endswith("NotComparable")
            return JaxReference(None, note, None if comparable else f"the JAX backend's run failed: {why}")
        evidence = result.values[0]
        how = ", XLA-compiled" if fit and JIT else ""
        return JaxReference(evidence, f"judged: keras' JAX backend (jax {evidence['jax_version']}, "
                                      f"{_mesh(evidence)} mesh of virtual CPU devices{how})")


def both(references: References, jax: JaxReferences, spec: dict, values: list[dict] | None):
    """(the single-process torch Reference, the JaxReference) of a cell: the JAX one computed in
    the JAX references' thread while the torch one computes (two processes)."""
    if values is None:
        return references.lookup(spec), JaxReference(None, "not run: the ranks gave no evidence")
    pending = jax.submit(spec, values)
    return references.lookup(spec), jax.result(pending)
