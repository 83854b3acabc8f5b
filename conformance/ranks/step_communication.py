"""What one train step communicates on a rank: every collective (op, shapes, bytes), the build's
own redistributions and the gradients the optimizer receives (``measure_step_communication``).
The rule that judges it is ``conformance.judge.communication``.
"""

from __future__ import annotations

import contextlib


def _tensors(value) -> list:
    """The tensors in an op's arguments or result: the leaves of torch's pytree (lists, tuples,
    dicts and named tuples flattened) that are tensors."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _placements(tensor) -> list[str]:
    return [str(p) for p in tensor.placements]


def _collective_recorder():
    """A dispatch mode that records every collective one step issues: op, input and output shapes,
    dtype, bytes, and the explicit redistribution that issued it (``made_by``, set by
    ``_explicit_redistributions``; None: DTensor issued it inside an op, for its sharding strategy).

    It works as torch's ``CommDebugMode`` (``torch.distributed.tensor.debug``) does and counts the
    ops that one counts (its ``comm_registry`` of functional collectives and its module's
    ``c10d_collective_ops``): it answers an op with a DTensor argument ``NotImplemented``, so
    DTensor's own dispatch runs and issues its collectives as plain-tensor ops, which it sees. It
    is not CommDebugMode itself because that one also enters a module tracker whose per-module
    forward hooks leak when a module runs twice under it (measured on torch 2.13: a second
    measurement then raised ``IndexError`` in ``_fw_set_module_hook``), and this needs no module.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    collectives = set(CommDebugMode().comm_registry) | set(c10d_collective_ops)

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    class CollectiveRecorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[dict] = []
            self.made_by: int | None = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **kwargs)
            if func._overloadpacket in collectives:
                inputs, outputs = _tensors((args, kwargs)), _tensors(out)
                self.calls.append({
                    "op": func._overloadpacket._qualified_op_name.split("::")[-1],
                    "inputs": [list(t.shape) for t in inputs],
                    "outputs": [list(t.shape) for t in outputs],
                    "dtype": str(inputs[0].dtype).replace("torch.", "") if inputs else "",
                    # What the collective holds on this rank at its largest: an all-gather's
                    # output, a reduce-scatter's input, an all-reduce's buffer.
                    "bytes": max(size(inputs), size(outputs)),
                    "made_by": self.made_by,
                })
            return out

    return CollectiveRecorder()


@contextlib.contextmanager
def _beneath_current_modes(mode):
    """Enter dispatch ``mode`` BELOW the modes already on the stack (the Keras promotion mode).

    On top it would break what it measures: CommDebugMode answers ``NotImplemented`` for every op
    with a DTensor argument so that DTensor's own dispatch runs, and the modes under it never see
    that op, so the promotion mode would not promote a plain tensor and the step would raise a
    mixed-tensor error the build does not have. Beneath, the promotion mode sees every op first,
    as without the recorder, and the recorder then sees the DTensor ops and their collectives
    (torch's private mode-stack helpers, listed in ``fixtures/torch_internals.py``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    above = [_pop_mode() for _ in range(len(_get_current_dispatch_mode_stack()))]  # top first
    try:
        with mode:
            for other in reversed(above):
                _push_mode(other)
            try:
                yield mode
            finally:
                for _ in above:
                    _pop_mode()
    finally:
        for other in reversed(above):
            _push_mode(other)


@contextlib.contextmanager
def _explicit_redistributions(recorder, redistributions: list):
    """Record each ``DTensor.redistribute`` the build calls itself (``full_tensor()`` is one: it
    redistributes to Replicate), with the tensor's global shape and placements before and after
    and its local size before and after, and tag the collectives it issues (``made_by``: its
    index). DTensor's op dispatch reshards operands without this method, so what it records is
    what the build asked for, not a sharding strategy DTensor chose for an op."""
    from torch.distributed.tensor import DTensor

    original = DTensor.redistribute

    def redistribute(self, *args, **kwargs):
        index, outer = len(redistributions), recorder.made_by
        redistributions.append({"shape": list(self.shape), "from": _placements(self),
                                "local_numel": self.to_local().numel()})
        recorder.made_by = index
        try:
            result = original(self, *args, **kwargs)
        finally:
            recorder.made_by = outer
        redistributions[index].update({"to": _placements(result), "result_local_numel": result.to_local().numel()})
        return result

    DTensor.redistribute = redistribute
    try:
        yield
    finally:
        DTensor.redistribute = original


@contextlib.contextmanager
def _gradients_received(optimizer, received: list):
    """Record what the train step hands ``optimizer.apply``: per variable path, its gradient's
    type (a DTensor with placements and local shape, or a plain tensor), global shape and the
    bytes this rank holds of it."""
    from torch.distributed.tensor import DTensor

    apply = optimizer.apply

    def spy(grads, trainable_variables=None):
        for grad, variable in zip(grads, trainable_variables or [None] * len(grads), strict=False):
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            entry = {"path": getattr(variable, "path", None), "type": type(grad).__name__, "shape": list(grad.shape),
                     "bytes": local.numel() * local.element_size()}  # as this rank holds it
            if isinstance(grad, DTensor):
                entry.update(placements=_placements(grad), local_shape=list(local.shape))
            received.append(entry)
        return apply(grads, trainable_variables)

    optimizer.__dict__["apply"] = spy  # the instance, past Keras' attribute tracking
    try:
        yield
    finally:
        optimizer.__dict__.pop("apply", None)


def measure_step_communication(model, x, y) -> dict:
    """What ONE train step communicates and materialises on this rank: ``model.train_on_batch(x, y)``
    on a local batch, eagerly (``torch.compiler.set_stance("force_eager")``: dynamo compiles no
    frame under a dispatch mode anyway, so a ``jit`` cell's step is measured as the eager code it
    traces), under ``_collective_recorder``.

    Run after the cell's evidence is taken: it trains the model one more step, so it changes no
    weight, loss, prediction or compile counter the other checks read. Returns plain data:

    - ``calls``: each collective in order (op, shapes, bytes, ``made_by``); ``ops``: op -> count
      and bytes; ``count`` and ``bytes``: the totals;
    - ``redistributions``: the build's own ``DTensor.redistribute`` calls (``full_tensor`` included);
    - ``gradients``: what the optimizer received, per variable.

    What is judged against the layout is ``conformance.judge.communication``'s part.
    """
    import torch

    recorder, redistributions, gradients = _collective_recorder(), [], []
    with (torch.compiler.set_stance("force_eager"), _gradients_received(model.optimizer, gradients),
          _explicit_redistributions(recorder, redistributions), _beneath_current_modes(recorder)):
        model.train_on_batch(x, y)
    ops: dict[str, dict] = {}
    for call in recorder.calls:
        entry = ops.setdefault(call["op"], {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += call["bytes"]
    return {"measured": "one eager train_on_batch on this rank's first local batch, after the evidence",
            "count": len(recorder.calls), "bytes": sum(c["bytes"] for c in recorder.calls), "ops": ops,
            "calls": recorder.calls, "redistributions": redistributions, "gradients": gradients}
