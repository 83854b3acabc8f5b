"""The suite's reproducer families (``--conformance-repro``): what a standalone script of a
training or an op cell inlines, and the code that runs and judges the cell in it.

The plugin writes the scripts (``keras_dtensor_conformance.report.reproducers``) for the families
the suite offers through its hook (``conftest.pytest_conformance_reproducer_families``), so the
modules a script inlines are named here, beside them, not in the plugin. A training script runs
``ranks/train.train`` and judges with ``judge/fit_checks.fit_failure``, the order of checks the
suite's judge uses; it compares with a single-process run of the same cell that it starts itself,
and does not run the NumPy oracle. An op script runs ``ranks/ops.op_cell`` and judges with
``judge/op_checks.op_failure``. A workflow script runs ``ranks/workflows.run_flow`` and judges with
``judge/workflows.workflow_failure`` against one process running the same flow, started as a
training script starts its reference (``_WITH_REFERENCE``, the code both share).
"""

from __future__ import annotations

from keras_dtensor_conformance import Family

#: The code of a script that compares with a single-process run it starts itself: ``_cell(spec,
#: distributed=True)`` runs the cell on this process, ``_reference_spec(spec)`` is the one process's
#: spec; the family defines both.
_WITH_REFERENCE = '''
#: torchrun's variables: the single-process run must not join (or think it is in) the group.
_GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _subcommand(args):
    """``FILE --reference OUT``: the single-process run, in a process of its own (no group, no
    distribution), as the suite's reference runs; what ``_cell`` returns is pickled to OUT."""
    import pickle

    if len(args) != 2 or args[0] != "--reference":
        raise SystemExit(f"unknown arguments {args}: run this file with none")
    import keras

    keras.config.disable_traceback_filtering()
    value = _cell(_reference_spec(SPEC), False)
    with open(args[1], "wb") as f:
        pickle.dump(value, f)


def _reference():
    """This file run again with ``--reference``, torchrun's variables removed from its environment."""
    import pickle
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in _GROUP_VARIABLES and not k.startswith("TORCHELASTIC_")}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "reference.pkl")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--reference", out], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the single-process reference failed (exit {proc.returncode}):\\n{proc.stderr[-4000:]}")
        with open(out, "rb") as f:
            return pickle.load(f)


def _run():
    """What the suite's ranks ran for this cell; every rank's evidence, gathered (the suite's
    controller judges all ranks' evidence together, and so does every rank here); and the
    single-process reference, computed once by rank 0."""
    import torch.distributed as dist

    value = _cell(SPEC)
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    reference = [_reference() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(reference, src=0)
    return values, reference[0]


'''

TRAINING = Family(
    name="training",
    prefix="fit",
    modules=("conformance.cell_data", "conformance.judge.sharding", "conformance.judge.slots",
             "conformance.judge.numerics", "conformance.judge.jax_compare", "conformance.judge.compile_evidence",
             "conformance.judge.communication", "conformance.ranks.feeding", "conformance.ranks.step_communication",
             "conformance.ranks.train", "conformance.judge.fit_checks"),
    spec_comment="The cell, literally: model, optimizer (class and arguments), data source, compile mode, layout.",
    code='''
#: What a run that does not reproduce did.
_cell, _reference_spec = train, reference_spec
_PASSED = ("trained and passed the suite's checks (sharding, numbers against a single-process run, "
           "compilation; the suite's NumPy oracle is not run here)")
''' + _WITH_REFERENCE + '''
def _judge(evidence):
    """The suite's own checks in the suite's order (fit_failure, conformance/judge/fit_checks.py,
    inlined above), against the JAX evidence the suite judged the cell with: (verdict, message) or None."""
    values, reference = evidence
    found = fit_failure(SPEC, values, len(values), reference, jax=JAX_REFERENCE)
    if found is not None and found[0] == NOT_COMPARABLE:  # the suite skips the cell here
        print(f"numbers not compared: {found[1]}", flush=True)
        return None
    return found
''',
)

OPS = Family(
    name="op",
    prefix="ops",
    modules=("conformance.ranks.ops", "conformance.judge.op_checks"),
    spec_comment="The cell, literally: op_cell's arguments (op, second operand, placement, compile mode).",
    code='''
#: What a run that does not reproduce did.
_PASSED = "the op ran and passed the suite's checks (value, placements, compilation)"


def _subcommand(args):
    raise SystemExit(f"unknown arguments {args}: run this file with none")


def _run():
    """What the suite's ranks ran for this cell, then every rank's evidence, gathered: the suite's
    controller judges all ranks' evidence together, and so does every rank here."""
    import torch.distributed as dist

    value = op_cell(**SPEC)
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _judge(values):
    """The suite's own checks (conformance/op_checks.py, inlined above): (verdict, message) or None."""
    return op_failure(SPEC["op"], SPEC["compile_mode"], values)
''',
)

def _flow_code(passed: str, run: str, judge: str, doc: str) -> str:
    """The code of a family whose rank function ``run(spec, distributed)`` runs a flow in every process and
    in one process (``_WITH_REFERENCE``), writing files (where the spec names a folder) into a folder of each
    process's own, and whose judge ``judge`` (an expression of ``values``, ``reference``) skips a flow the
    process count cannot run: the workflow and KerasHub families."""
    return f'''
#: What a run that does not reproduce did.
_PASSED = {passed!r}


def _cell(spec, distributed=True):
    """``{run}``; a flow that writes files writes them into a folder of this process's own."""
    import tempfile

    return {run}(dict(spec, folder=tempfile.mkdtemp()) if "folder" in spec else spec, distributed)


def _reference_spec(spec):
    return dict(spec, layout={{"kind": "single"}}, layout_name="single", compile="nojit")
''' + _WITH_REFERENCE + f'''

def _judge(evidence):
    """The suite's own checks in the suite's order ({doc}, inlined above): (verdict, message) or None."""
    values, reference = evidence
    skips = [v["skip"] for v in values if "skip" in v]
    if skips:
        print(f"not run: {{skips[0]}}", flush=True)
        return None
    return {judge}
'''


WORKFLOWS = Family(
    name="workflow",
    prefix="workflows",
    modules=(*TRAINING.modules, "conformance.ranks.workflows", "conformance.judge.workflows"),
    spec_comment="The cell, literally: the flow, its compile mode and layout (a second layout where the flow has one).",
    code=_flow_code("ran the flow and passed the suite's checks (frozen variables, layouts, every fit's numbers "
                    "against one process running the same flow, compilation)", "run_flow",
                    'workflow_failure(SPEC, values, reference, FLOWS[SPEC["flow"]].layout_phases)',
                    "workflow_failure, conformance/judge/workflows.py"),
)

KERASHUB = Family(
    name="KerasHub",
    prefix="kerashub",
    modules=(*TRAINING.modules, "conformance.judge.workflows", "conformance.ranks.hub", "conformance.judge.hub"),
    spec_comment=("The cell, literally: the KerasHub model, the flow, the layout (the authors' map is made on each rank). "
                  "KerasHub must be importable too (installed, or PYTHONPATH=/path/to/keras-hub-checkout)."),
    code=_flow_code("ran the flow and passed the suite's checks (the map's layouts, slots and the rest whole, every "
                    "fit's numbers and generate's ids against one process running the same flow)", "run_hub",
                    "hub_failure(SPEC, values, reference)", "hub_failure, conformance/judge/hub.py"),
)

#: What ``conftest.pytest_conformance_reproducer_families`` offers the plugin.
FAMILIES = (TRAINING, OPS, WORKFLOWS, KERASHUB)
