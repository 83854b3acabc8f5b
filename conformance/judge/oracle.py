"""The NumPy oracle: what a core set of training cells must compute, independent of any Keras build.

The reference (conformance/reference.py) is Keras itself, single-process: a maths bug that the
single-process and the distributed runs share passes it. The oracle is written from Keras'
documented update rules in float64 NumPy, imports no Keras, and starts from the cell's own
initial weights (``rank_train.train``'s ``initial_weights``) and the global data
(``cell_data.make_arrays``, batches of ``cell_data.BATCH`` in order, no shuffle).

Core set (``scope``): the MLP of ``rank_train.build_model("mlp")`` (Dense 16 relu, Dense 4),
MSE loss, data fed as arrays or a DataLoader, any layout and compile mode, and the optimizers
of ``axes.OPTIMIZERS`` that name a rule of ``RULES`` (SGD, SGD with momentum, Adam, AdamW and
RMSprop). A rule models its Keras class with no argument beyond its hyperparameters, and
``check_named_rules`` holds every entry to that at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from conformance import axes, cell_data
from conformance.cell_data import policy

#: The build computes in float32, the oracle in float64: the build's rounding (~6e-8 relative
#: per operation) accumulates over the forward, backward and update of each of the STEPS steps.
#: These are the reference comparison's float32 tolerances. Measured on the default build over the
#: core set in one process (``scripts/oracle_margin.py``; docs/measurements.md, "The NumPy oracle's
#: tolerance"), the worst difference uses 0.28 of them (predict, max abs 5.5e-6), the weights 0.03.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}

#: The MLP as data: (layer name, activation) in order; weights are found by path suffix.
MLP = (("dense_a", "relu"), ("dense_b", None))
MODELS = {"mlp": MLP}
#: Data sources that feed the global batches in order, unweighted (so the oracle's batches).
DATA = ("arrays", "dataloader")
#: compile mode -> steps_per_execution: Keras calls on_train_batch_end once per execution.
STEPS_PER_EXECUTION = {"spe4": 4}


# ---------------------------------------------------------------- update rules (one variable)
def sgd(w, g, slots: dict, t: int, hp: dict):
    """keras.optimizers.SGD: ``w -= lr * g``; with momentum, ``m = momentum * m - lr * g``,
    ``w += m`` (the velocity holds the learning rate; with a constant one, the same steps as
    PyTorch's ``m = momentum * m + g``, ``w -= lr * m``)."""
    if hp["momentum"] == 0:
        return w - hp["learning_rate"] * g
    slots["m"] = hp["momentum"] * slots.get("m", 0.0) - hp["learning_rate"] * g
    return w + slots["m"]


def adam(w, g, slots: dict, t: int, hp: dict):
    """keras.optimizers.Adam, step ``t`` counted from 1 (``iterations + 1``): bias correction is
    folded into the step size, ``alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``, and
    epsilon is added to ``sqrt(v)`` of the uncorrected ``v``: ``w -= alpha * m / (sqrt(v) + eps)``
    (not the paper's ``m_hat / (sqrt(v_hat) + eps)``)."""
    b1, b2 = hp["beta_1"], hp["beta_2"]
    m = slots["m"] = slots.get("m", 0.0) + (g - slots.get("m", 0.0)) * (1 - b1)
    v = slots["v"] = slots.get("v", 0.0) + (g * g - slots.get("v", 0.0)) * (1 - b2)
    alpha = hp["learning_rate"] * np.sqrt(1 - b2**t) / (1 - b1**t)
    return w - alpha * m / (np.sqrt(v) + hp["epsilon"])


def adamw(w, g, slots: dict, t: int, hp: dict):
    """keras.optimizers.AdamW: decoupled weight decay first, ``w -= w * weight_decay * lr`` on
    every variable (biases too: Keras excludes none by default), then Adam's step with the
    gradient taken at the undecayed weights."""
    return adam(w - w * hp["weight_decay"] * hp["learning_rate"], g, slots, t, hp)


def rmsprop(w, g, slots: dict, t: int, hp: dict):
    """keras.optimizers.RMSprop (no momentum, not centered): ``v = rho * v + (1 - rho) * g**2``,
    ``w -= lr * g / sqrt(v + eps)`` (epsilon inside the root, unlike Adam)."""
    v = slots["v"] = hp["rho"] * slots.get("v", 0.0) + (1 - hp["rho"]) * g * g
    return w - hp["learning_rate"] * g / np.sqrt(v + hp["epsilon"])


@dataclasses.dataclass(frozen=True)
class Rule:
    """The update rule of one ``keras.optimizers`` class, with Keras' default hyperparameters: the
    arguments it models. An optimizer that sets any other argument is outside the rule."""

    keras_class: str
    update: Callable
    defaults: dict

    def hyperparameters(self, kwargs: dict) -> dict:
        """Keras' defaults overridden by the optimizer's arguments."""
        return {**self.defaults, **kwargs}


#: rule name -> rule. An ``axes.OPTIMIZERS`` entry names its rule (``oracle=``) to be in the core set.
RULES = {
    "sgd": Rule("SGD", sgd, {"learning_rate": 0.01, "momentum": 0.0}),
    "adam": Rule("Adam", adam, {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}),
    "adamw": Rule("AdamW", adamw, {"learning_rate": 0.001, "weight_decay": 0.004, "beta_1": 0.9, "beta_2": 0.999,
                                   "epsilon": 1e-7}),
    "rmsprop": Rule("RMSprop", rmsprop, {"learning_rate": 0.001, "rho": 0.9, "epsilon": 1e-7}),
}


# ---------------------------------------------------------------- scope
def _optimizer_gap(optimizer: dict) -> str | None:
    """Why no rule models ``optimizer`` (an ``Optimizer.spec``) as it is configured, or None."""
    modelled = next((r for r in RULES.values() if r.keras_class == optimizer["class"]), None)
    if modelled is None:
        return f"no rule for keras.optimizers.{optimizer['class']}"
    extra = sorted(set(optimizer) - {"class", "kwargs"})
    extra += sorted(set(optimizer.get("kwargs", {})) - set(modelled.defaults))
    return f"{optimizer['class']} with {', '.join(extra)} has no rule" if extra else None


def check_named_rules(optimizers: dict) -> None:
    """Each ``axes.OPTIMIZERS`` entry's ``oracle`` is right: a rule of ``RULES``, of the entry's
    Keras class, modelling every argument the entry sets; and an entry that a rule models names
    it, so that no entry leaves the core set by omission. Raises ValueError naming the entry."""
    classes = [r.keras_class for r in RULES.values()]
    if len(set(classes)) != len(classes):
        raise ValueError(f"oracle.RULES: one rule per keras.optimizers class, not {classes}")
    for name, entry in optimizers.items():
        gap = _optimizer_gap(entry.spec)
        where = f"axes.OPTIMIZERS[{name!r}]"
        if entry.oracle is None:
            if gap is None:
                named = next(n for n, r in RULES.items() if r.keras_class == entry.keras_class)
                raise ValueError(f"{where}: the oracle's rule {named!r} models it as configured; "
                                 f"say oracle={named!r}")
        elif entry.oracle not in RULES:
            raise ValueError(f"{where}: oracle={entry.oracle!r} is not a rule of oracle.RULES "
                             f"({', '.join(RULES)}); None where no rule models it")
        elif RULES[entry.oracle].keras_class != entry.keras_class:
            raise ValueError(f"{where}: oracle={entry.oracle!r} models keras.optimizers."
                             f"{RULES[entry.oracle].keras_class}, not {entry.keras_class}")
        elif gap is not None:
            raise ValueError(f"{where}: oracle={entry.oracle!r}, but {gap}")


check_named_rules(axes.OPTIMIZERS)


def scope(spec: dict) -> str | None:
    """None when the oracle judges the cell ``spec``, else why it does not."""
    model = "twoinput" if spec["data"] == "dict" else spec["model"]
    if model not in MODELS:
        return f"no oracle for the {model} model"
    if spec["data"] not in DATA:
        return f"no oracle for the {spec['data']} data source"
    if axes.OPTIMIZERS[spec["optimizer_name"]].oracle is None:
        return _optimizer_gap(spec["optimizer"])
    if policy(spec) != axes.POLICIES[0]:
        return f"the oracle computes in float64, not under {policy(spec)}"
    return None


def coverage(spec: dict) -> str:
    """What a cell's record says about the oracle: ``yes`` or ``no: <why>``."""
    gap = scope(spec)
    return "yes" if gap is None else f"no: {gap}"


def rule_of(spec: dict) -> Rule:
    """The rule that judges the cell ``spec`` (one in the core set: ``scope(spec)`` is None)."""
    return RULES[axes.OPTIMIZERS[spec["optimizer_name"]].oracle]


# ---------------------------------------------------------------- the model, in float64
def _path(weights: dict, layer: str, kind: str) -> str:
    (path,) = [p for p in weights if p.endswith(f"{layer}/{kind}")]
    return path


def forward(params: dict, x, model=MLP) -> tuple[np.ndarray, list]:
    """The model's output and, per layer, (input, pre-activation) for the backward pass."""
    trace = []
    h = x
    for layer, activation in model:
        pre = h @ params[_path(params, layer, "kernel")] + params[_path(params, layer, "bias")]
        trace.append((h, pre))
        h = np.maximum(pre, 0.0) if activation == "relu" else pre
    return h, trace


def mse(pred, y) -> float:
    """Keras' MeanSquaredError with sum_over_batch_size: the mean over batch and outputs."""
    return float(np.mean((pred - y) ** 2))


def loss_and_grads(params: dict, x, y, model=MLP) -> tuple[float, dict]:
    """The batch's MSE and its gradient for every weight (relu' is 0 at 0, as torch's)."""
    pred, trace = forward(params, x, model)
    grads = {}
    d = 2.0 * (pred - y) / pred.size
    for (layer, activation), (h, pre) in zip(reversed(model), reversed(trace), strict=True):
        if activation == "relu":
            d = d * (pre > 0)
        grads[_path(params, layer, "kernel")] = h.T @ d
        grads[_path(params, layer, "bias")] = d.sum(axis=0)
        d = d @ params[_path(params, layer, "kernel")].T
    return mse(pred, y), grads


# ---------------------------------------------------------------- training
@dataclasses.dataclass
class Expected:
    """What the cell must compute: per batch, the loss before its update; what Keras logs."""

    batch_losses: list[float]
    step_losses: list[float]  # the logged loss: running mean weighted by batch size, per execution
    epoch_loss: list[float]
    evaluate: float
    predict: np.ndarray
    weights: dict[str, np.ndarray]


def global_data(model: str = "mlp", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x, y, _ = cell_data.make_arrays(model, seed)
    return np.asarray(x, dtype="float64"), np.asarray(y, dtype="float64")


def logged(batch_losses: list[float], sizes: list[int], steps_per_execution: int) -> list[float]:
    """Keras' logged loss after each execution: the batch-size-weighted mean of the epoch so far."""
    ends = [min(i + steps_per_execution, len(batch_losses)) for i in range(0, len(batch_losses), steps_per_execution)]
    losses, sizes = np.asarray(batch_losses), np.asarray(sizes, dtype="float64")
    return [float(np.sum(losses[:e] * sizes[:e]) / np.sum(sizes[:e])) for e in ends]


def expected(spec: dict, initial_weights: dict) -> Expected:
    """Train the cell's model on the global batches in float64 from ``initial_weights``."""
    x, y = global_data(seed=spec.get("seed", 0))
    params = {p: np.asarray(w, dtype="float64") for p, w in initial_weights.items()}
    rule = rule_of(spec)
    hp = rule.hyperparameters(spec["optimizer"].get("kwargs", {}))
    slots: dict[str, dict] = {p: {} for p in params}
    losses, sizes = [], []
    for step in range(cell_data.STEPS):
        rows = slice(step * cell_data.BATCH, (step + 1) * cell_data.BATCH)
        loss, grads = loss_and_grads(params, x[rows], y[rows])
        losses.append(loss)
        sizes.append(len(y[rows]))
        params = {p: rule.update(w, grads[p], slots[p], step + 1, hp) for p, w in params.items()}
    step_losses = logged(losses, sizes, STEPS_PER_EXECUTION.get(spec["compile"], 1))
    prediction, _ = forward(params, x)
    return Expected(losses, step_losses, step_losses[-1:], mse(prediction, y), prediction, params)


# ---------------------------------------------------------------- comparison
def compare(name: str, got, want) -> str | None:
    """None if ``got`` (the build's float32) matches the oracle's float64 ``want``, else what differs."""
    got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
    if got.shape != want.shape:
        return f"{name} differs from the NumPy oracle: shape {got.shape}, oracle {want.shape}"
    if np.allclose(got, want, **TOLERANCE):
        return None
    worst = np.abs(got - want).max() if np.isfinite(got).all() else float("nan")
    return (f"{name} differs from the NumPy oracle: max abs difference {worst:.3g} "
            f"(rtol {TOLERANCE['rtol']}, atol {TOLERANCE['atol']})")


def weight_problems(evidence: dict, want: Expected, where: str) -> list[str]:
    """Every final weight of ``evidence`` against the oracle's."""
    problems = []
    for path, weight in want.weights.items():
        if path not in evidence["weights"]:
            problems.append(f"{where}weight {path} missing")
            continue
        problem = compare(f"weight {path}", evidence["weights"][path], weight)
        if problem:
            problems.append(where + problem)
    return problems


#: Quantities of a single-process run compared with the oracle (besides the final weights).
REFERENCE_QUANTITIES = ("step_losses", "epoch_loss", "evaluate", "predict")


def reference_problems(spec: dict, evidence: dict, where: str) -> list[str]:
    """The single-process reference's losses, evaluate, predict and weights against the oracle."""
    want = expected(spec, evidence["initial_weights"])
    problems = [where + p for q in REFERENCE_QUANTITIES if (p := compare(q, evidence[q], getattr(want, q)))]
    return problems + weight_problems(evidence, want, where)


def distributed_problems(spec: dict, values: list[dict]) -> list[str]:
    """Every rank's final (global) weights against the oracle, from that rank's initial weights.

    Step losses of a distributed run are the reference comparison's business: they are the
    global batch's only where every rank feeds it, and the oracle covers them in the reference.
    """
    problems = []
    for rank, value in enumerate(values):
        problems += weight_problems(value, expected(spec, value["initial_weights"]), f"rank {rank}: ")
    return problems
