"""The engine's telemetry (orchestrator/pipeline/telemetry.py): the probe keeps what each worker answered
and a time for it, a whole step's bytes are the connections' counters moved, and the summary's means and
bytes per token are the plain sums of the steps it was given, worked out here by hand."""
from orchestrator.pipeline.telemetry import Mark, StageTime, StepTime, Telemetry

import pytest

pytestmark = pytest.mark.unit


class FakeClient:
    def __init__(self, endpoint: str, free: int, total: int):
        self.endpoint, self.free, self.total = endpoint, free, total
        self.sent_bytes = self.received_bytes = 0
        self.asked = 0

    def device_memory(self) -> tuple[int, int]:
        self.asked += 1
        self.sent_bytes += 13
        self.received_bytes += 25
        return self.free, self.total


def test_probe_keeps_each_workers_answer_and_a_round_trip():
    t = Telemetry()
    assert t.due()
    a, b = FakeClient("a:1", 100, 400), FakeClient("b:2", 7, 9)
    t.probe([a, b])
    assert not t.due(60.0) and t.due(0.0)
    probes = t.probes()
    assert (a.asked, b.asked) == (1, 1)
    assert [(e, p.free, p.total) for e, p in probes.items()] == [("a:1", 100, 400), ("b:2", 7, 9)]
    assert all(p.rtt >= 0 for p in probes.values())
    a.free = 50  # the next probe sees memory as it is then
    t.probe([a])
    assert t.probes()["a:1"].free == 50


def test_a_whole_step_counts_the_bytes_each_connection_moved():
    t = Telemetry()
    a, b = FakeClient("a:1", 0, 0), FakeClient("b:2", 0, 0)
    a.sent_bytes, b.received_bytes = 1000, 5
    mark = Mark([a, b])
    a.sent_bytes += 300
    a.received_bytes += 40
    b.received_bytes += 800
    t.whole("stepwise", mark, 4)
    (step,) = t.steps()
    assert (step.kind, step.n_tokens) == ("stepwise", 4) and step.seconds >= 0
    assert step.stages == (StageTime("a:1", None, None, 300, 40), StageTime("b:2", None, None, 0, 800))


def test_summary_means_bytes_per_token_and_throughput():
    t = Telemetry(keep=2)
    t.add(StepTime("waves", 99.0, 9.9, 50, (StageTime("a:1", 9.0, 9.0, 1, 1),)))  # pushed out by the next two
    t.add(StepTime("waves", 100.0, 0.5, 2, (StageTime("a:1", 0.1, 0.2, 200, 60), StageTime("b:2", 0.0, 0.3, 90, 10))))
    t.add(StepTime("waves", 100.5, 0.5, 3, (StageTime("a:1", 0.3, 0.4, 300, 90), StageTime("b:2", 0.2, 0.1, 110, 15))))
    s = t.summary(now=101.0)
    assert [(x["kind"], x["n_tokens"], x["age"]) for x in s["steps"]] == [("waves", 2, 1.0), ("waves", 3, 0.5)]
    assert s["steps"][0]["stages"][1] == {"endpoint": "b:2", "wait": 0.0, "busy": 0.3, "sent": 90, "received": 10}
    assert s["throughput"] == pytest.approx(3 / 0.5)  # the second step's tokens over the time between their ends
    a, b = s["stages"]["a:1"], s["stages"]["b:2"]
    assert (a["wait"], a["busy"]) == (pytest.approx(0.2), pytest.approx(0.3))
    assert (a["sent_per_token"], a["received_per_token"], a["relayed_per_token"]) == (500 / 5, 150 / 5, 150 / 5)
    assert (b["wait"], b["busy"], b["sent_per_token"], b["received_per_token"]) == (pytest.approx(0.1), pytest.approx(0.2), 40, 5)
    assert s["probes"] == {}


def test_summary_of_whole_steps_has_bytes_but_no_stage_times():
    t = Telemetry()
    t.add(StepTime("ring", 10.0, 1.0, 8, (StageTime("a:1", None, None, 800, 80),)))
    s = t.summary(now=10.0)
    assert s["throughput"] is None  # one step: no span to divide by
    assert s["stages"]["a:1"] == {"wait": None, "busy": None, "sent_per_token": 100, "received_per_token": 10,
                                  "relayed_per_token": None}  # nothing relayed


def test_relayed_bytes_per_token_count_the_relayed_steps_only():
    t = Telemetry()
    t.add(StepTime("waves", 10.0, 0.5, 4, (StageTime("a:1", 0.1, 0.2, 100, 4000),)))  # a prompt, relayed
    t.add(StepTime("stepwise", 11.0, 0.1, 1, (StageTime("a:1", None, None, 50, 20),)))  # a token, pushed on
    a = t.summary(now=11.0)["stages"]["a:1"]
    assert a["relayed_per_token"] == 1000 and a["received_per_token"] == 4020 / 5
