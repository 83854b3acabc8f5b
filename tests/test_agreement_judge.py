"""The agreement cells' judge on hand-made evidence: no ranks, no Keras.

Metrics: a rank's logs must equal the reference's over the global batch AND the other ranks'; the
per-rank local values whose mean is the global one (which the training cells accept) are refused.
Callbacks: ranks that decide differently at an epoch get one verdict naming the callback and the
epoch, also when a rank hung and its decisions come only from what it printed.
"""

from __future__ import annotations

import json

from keras_dtensor_conformance.rank.outcomes import HANG, OK, PoolResult, RankOutcome
from keras_dtensor_conformance.verdicts import ERROR, HANG_VERDICT, NUMERICS, CellFailure

from conformance.judge import agreement
from conformance.judge.cells import judge_agreement
from conformance.ranks import agreement as rank_agreement
from conformance.test_agreement import callback_cells, metric_cells

METRIC_SPEC = {"metric": "mae", "layout": {"kind": "data-parallel"}}
CALLBACK_SPEC = {"callback": "earlystopping", "layout": {"kind": "data-parallel"}}


def logs(mae: float, loss: float = 1.0) -> dict:
    return {"history": {"loss": [loss], "mae": [mae]}, "epoch_logs": [{"loss": loss, "mae": mae}],
            "evaluate": {"loss": loss, "mae": mae}, "decisions": []}


def decision(epoch: int, stop: bool, val_loss: float, lr: float = 0.01, **extra) -> dict:
    return {"epoch": epoch, "stop_training": stop, "learning_rate": lr, "logs": {"val_loss": val_loss}, **extra}


def callback_value(decisions: list[dict]) -> dict:
    val = [d["logs"]["val_loss"] for d in decisions]
    return {"history": {"val_loss": val}, "epoch_logs": [d["logs"] for d in decisions], "decisions": decisions}


def printed(decisions: list[dict]) -> str:
    return "".join(f"noise\n{agreement.DECISION_PREFIX}{json.dumps(d)}\n" for d in decisions)


def test_equal_global_logs_pass():
    assert agreement.agreement_failure(METRIC_SPEC, [logs(0.5), logs(0.5)], ["", ""], logs(0.5)) is None


def test_local_logs_whose_mean_is_global_are_refused_naming_metric_rank_and_values():
    verdict, message = agreement.agreement_failure(METRIC_SPEC, [logs(0.4), logs(0.6)], ["", ""], logs(0.5))
    assert verdict == NUMERICS
    assert "metric mae" in message and "History['mae'] epoch 1: rank 0 reports 0.4, rank 1 0.6" in message


def test_agreeing_ranks_off_the_reference_are_numerics():
    verdict, message = agreement.agreement_failure(METRIC_SPEC, [logs(1.0), logs(1.0)], ["", ""], logs(0.5))
    assert verdict == NUMERICS
    assert "evaluate()['mae']: rank 0 reports 1, the single-process reference over the global batch 0.5" in message


def test_a_log_the_reference_has_and_a_rank_lacks_is_named():
    short = logs(0.5)
    del short["evaluate"]["mae"]
    verdict, message = agreement.agreement_failure(METRIC_SPEC, [short, short], ["", ""], logs(0.5))
    assert verdict == NUMERICS and "evaluate()['mae']: rank 0 does not report it" in message


def test_decisions_read_from_stdout_survive_a_cut_line():
    text = printed([decision(0, False, 5.0)]) + agreement.DECISION_PREFIX + '{"epoch": 1, "sto'
    assert [d["epoch"] for d in agreement.decisions_from_stdout(text)] == [0]


def test_a_rank_that_stops_alone_and_a_hung_peer_get_one_numerics_verdict_naming_callback_and_epoch():
    stopped = [decision(0, False, 8.7), decision(1, True, 8.7)]
    went_on = [decision(0, False, 1.4), decision(1, False, 1.4)]
    found = agreement.agreement_failure(CALLBACK_SPEC, [callback_value(stopped), None], ["", printed(went_on)], None)
    verdict, message = found
    assert verdict == NUMERICS
    assert message.startswith("EarlyStopping(monitor='val_loss'): the ranks decided differently at epoch 2")
    assert "rank 0 stopped training (it saw val_loss=8.7)" in message
    assert "rank 1 went on training (it saw val_loss=1.4)" in message


def test_different_decisions_on_the_same_value_are_an_error():
    a = [decision(0, False, 5.0), decision(1, True, 5.0)]
    b = [decision(0, False, 5.0), decision(1, False, 5.0)]
    verdict, message = agreement.decisions_differ("earlystopping", [a, b], [True, True])
    assert verdict == ERROR and "on the same val_loss" in message


def test_learning_rate_and_checkpoint_decisions_are_compared():
    a = [decision(0, False, 5.0, lr=0.01, wrote_checkpoint=True)]
    b = [decision(0, False, 5.0, lr=0.005, wrote_checkpoint=True)]
    verdict, message = agreement.decisions_differ("reducelronplateau", [a, b], [True, True])
    assert "ReduceLROnPlateau" in message and "rank 1 ended the epoch with learning rate 0.005" in message
    c = [decision(0, False, 5.0, wrote_checkpoint=False)]
    verdict, message = agreement.decisions_differ("modelcheckpoint", [a, c], [True, True])
    assert "rank 0 wrote the checkpoint (it saw val_loss=5); rank 1 wrote no checkpoint" in message


def test_a_hung_rank_with_nothing_printed_for_an_epoch_says_nothing_about_it():
    a = [decision(0, False, 5.0), decision(1, True, 5.0)]
    assert agreement.decisions_differ("earlystopping", [a, a[:1]], [True, False]) is None


def test_agreeing_decisions_unlike_the_reference_are_numerics():
    ranks = callback_value([decision(0, False, 5.0), decision(1, True, 5.0)])
    reference = callback_value([decision(0, False, 5.0), decision(1, False, 5.0)])
    verdict, message = agreement.agreement_failure(CALLBACK_SPEC, [ranks, ranks], ["", ""], reference)
    assert verdict == NUMERICS
    assert ("at epoch 2 every rank stopped training, the single-process reference over the global batch "
            "went on") in message


def _result(outcomes):
    return PoolResult("conformance.ranks.agreement.run", outcomes)


def _verdict(spec, result, reference) -> str:
    try:
        judge_agreement(spec, result, reference)
    except CellFailure as failure:
        return failure.verdict
    return "pass"


def test_judge_turns_a_hang_with_parted_decisions_into_numerics_and_a_plain_hang_stays_hang():
    stopped = [decision(0, False, 8.7), decision(1, True, 8.7)]
    went_on = [decision(0, False, 1.4), decision(1, False, 1.4)]
    reference = _result([RankOutcome(0, OK, value=callback_value(stopped))])
    parted = _result([RankOutcome(0, OK, value=callback_value(stopped), duration=1.0),
                      RankOutcome(1, HANG, stdout=printed(went_on), note="no answer within 30s")])
    assert _verdict(CALLBACK_SPEC, parted, reference) == NUMERICS
    agreed = _result([RankOutcome(0, HANG, stdout=printed(went_on[:1]), note="no answer"),
                      RankOutcome(1, HANG, stdout=printed(went_on[:1]), note="no answer")])
    assert _verdict(CALLBACK_SPEC, agreed, reference) == HANG_VERDICT


def test_default_tier_covers_dataparallel_colshard_and_batchshard_and_full_adds_more():
    layouts = {layout for *_, layout in metric_cells(False)} | {layout for _, layout in callback_cells(False)}
    assert {"dataparallel", "colshard", "batchshard"} <= layouts
    assert {m for m, *_ in metric_cells(False)} == set(rank_agreement.METRICS)
    assert len(metric_cells(True)) > len(metric_cells(False))
    assert len(callback_cells(True)) > len(callback_cells(False))
