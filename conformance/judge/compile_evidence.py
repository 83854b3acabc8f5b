"""Did a ``jit`` cell's train step really run compiled, whole? The evidence is torch._dynamo's own
instrumentation, diffed around ``fit`` on each rank (``rank_train._compiled_during``).

Keras calls ``torch.compile(train_step)`` itself, so the suite cannot choose the backend; it
reads what dynamo did. A step that compiled some graph but broke elsewhere runs the rest
eagerly, and "some graph compiled" alone would pass it. So a jit cell passes only when:

1. dynamo compiled at least one graph (else Keras fell back to eager);
2. no frame's compile failed (dynamo would have run it eagerly);
3. the graphs went through AOTAutograd, which compiles each graph's backward with it: the
   ``Tensor.backward()`` on their outputs runs those compiled backward graphs (there is no
   eager path for them);
4. every graph break has a reason in ``ACCEPTED_GRAPH_BREAKS``: breaks where the work on the
   other side of the break still runs in compiled graphs. Any other break (a Python call dynamo
   cannot trace, a ``torch._dynamo.graph_break()``) leaves code between two graphs running
   eagerly, and fails the cell with the break, its count and the frames it split.

Measured on keras-nightly 3.16.0.dev2026102704, ``test_fit[sgd-arrays-jit-dataparallel]``
(torch 2.13): 4 graphs, all through AOTAutograd: the model's forward (Keras' ``error_handler``
frame, 32 ops), zero_grad + loss (``train_step`` resumed at line 107, 69 ops), and the optimizer
update + metrics (resumed after ``loss.backward()``, 46 ops); the breaks are DDP's forward
wrapper (two reasons) and ``loss.backward()``, all three accepted below.
"""

from __future__ import annotations

#: substring of a dynamo graph-break reason -> why the work past that break is still compiled.
ACCEPTED_GRAPH_BREAKS = {
    "Tensor.backward()": "the backward it runs is made of AOTAutograd's compiled backward graphs "
                         "(Keras' torch trainer calls loss.backward() under DDP for its all-reduce hooks)",
    "DistributedDataParallel._inside_ddp_forward": "DDP's Python forward wrapper, skipped by dynamo "
                                                   "by design; the wrapped model's call compiles as a frame of its own",
    "set_runtime_stats_and_log": "DDP's logger, called from the same forward wrapper",
}


def accepted(reason: str) -> bool:
    return any(key in reason for key in ACCEPTED_GRAPH_BREAKS)


def compile_problems(value: dict) -> list[str]:
    """Why one rank's fit was not compiled whole (points 2-4 above; point 1 is judged first, with
    the build's warnings); empty when it was."""
    problems = [f"frame fell back to eager: {frame}" for frame in value["failed_frames"]]
    if value["aot_graphs"] == 0:
        problems.append("no graph went through AOTAutograd: the backward ran eagerly")
    for reason, info in value["graph_breaks"].items():
        if not accepted(reason):
            frames = "; ".join(info["frames"]) or "frame not recorded"
            problems.append(f"graph break ({info['count']}x, in {frames}): {reason}")
    if problems:  # what did compile, for the reader of the message
        problems.append(f"compiled frames: {', '.join(value['compiled_frames']) or 'none'}; "
                        f"frames dynamo left to run eagerly: {value['frames_not_compiled']}")
    return problems
