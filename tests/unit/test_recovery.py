"""Recovery.replan with its HELLO probe replaced by a list: a worker lost during the re-plan's own start-up
is left out and the start-up tried again over the rest; a start-up that fails with every worker still
answering is refused with one line; none answering is said so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.engine.recovery import LOST, UP, Recovery, RecoveryError
from orchestrator.pipeline.client import WorkerError


def recovery(answering: list[str], build) -> Recovery:
    rec = Recovery(["a:1", "b:2", "c:3"], [], build, tell=lambda line: None)
    rec.answering = lambda: list(answering)
    return rec


def pipe_over(endpoints):
    return SimpleNamespace(plans=[SimpleNamespace(endpoint=e) for e in endpoints], idle=[])


def test_a_worker_lost_during_the_start_up_is_left_out_and_it_is_tried_again():
    answering, built = ["a:1", "b:2"], []

    def build(endpoints):
        built.append(list(endpoints))
        if "b:2" in endpoints:  # b answered the HELLO, then went away during the upload
            answering.remove("b:2")
            raise WorkerError("worker b:2 closed the connection during SET_TENSOR", "b:2")
        return pipe_over(endpoints)

    rec = recovery(answering, build)
    pipe = rec.replan("worker c:3 closed the connection during GRAPH_COMPUTE")
    assert built == [["a:1", "b:2"], ["a:1"]]
    assert [p.endpoint for p in pipe.plans] == ["a:1"]
    assert rec.states == {"a:1": UP, "b:2": LOST, "c:3": LOST} and rec.replans == 1


def test_a_start_up_that_fails_with_every_worker_answering_is_refused():
    def build(endpoints):
        raise WorkerError("worker a:1 refused the buffer", "a:1")

    with pytest.raises(RecoveryError, match=r"the workers that answer \(a:1, b:2\) cannot take over: worker a:1 refused"):
        recovery(["a:1", "b:2"], build).replan("worker c:3 went away")


def test_the_last_worker_lost_during_the_start_up_ends_it():
    answering = ["a:1"]

    def build(endpoints):
        answering.clear()
        raise WorkerError("worker a:1 closed the connection during SET_TENSOR", "a:1")

    with pytest.raises(RecoveryError, match="worker a:1 closed the connection during SET_TENSOR; no worker answers"):
        recovery(answering, build).replan("worker c:3 went away")
