"""Evidence -> verdict, for every cell family: the one package where a cell's verdict is decided.

The rank side (``conformance/ranks``) only gathers evidence and returns it as plain data; the test
modules only run a cell and hand its evidence here: ``cells`` (training, op, setup, agreement,
on-batch, workflow and Keras-sharded cells) and ``scenarios``, which raise the verdict from the
checks of the modules beside them. This file imports nothing, so that a rank that reads one of those
modules' constants (``slots.factored_shapes``, ``agreement.DECISION_PREFIX``) imports only that
module, not pytest and every check.
"""
