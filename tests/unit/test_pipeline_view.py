"""The page's snapshot (orchestrator/serving/pipeline_view.py) reads the pipeline and engine as they are,
and the hooks other features fill (engine.worker_states, engine.draft_stats) when they exist."""
from types import SimpleNamespace as NS

from orchestrator.engine.slots import Metrics, Slot
from orchestrator.pipeline.placement import StagePlan
from orchestrator.pipeline.push import Link
from orchestrator.pipeline.telemetry import Probe, StageTime, StepTime, Telemetry
from orchestrator.serving import pipeline_view


def service(**engine_extra):
    plans = [StagePlan("a:1", range(0, 20), 100, 10, 5, 2), StagePlan("b:2", range(20, 30), 200, 20, 6, 3)]
    pipe = NS(model=NS(hparams=NS(n_layer=29)), plans=plans,
              features={"a:1": 7, "b:2": 0}, links=[Link(0, "a:1", "b:2", False, "llama.cpp's worker")], idle=["c:3"])
    slots = [Slot(0), Slot(1)]
    slots[1].job = object()
    engine = NS(pipe=pipe, failed=None, metrics=Metrics(tokens_predicted=5, tokens_predicted_seconds=0.5),
                slots=slots, deferred=3, processing=1, **engine_extra)
    return NS(name="m.gguf", engine=engine)


def test_snapshot_lists_workers_links_and_slots():
    s = pipeline_view.snapshot(service())
    assert [(w["endpoint"], w["kind"], w["layers"], w["state"]) for w in s["workers"]] == [
        ("a:1", "ours", [0, 20], "up"), ("b:2", "llama.cpp", [20, 29], "up"), ("c:3", "llama.cpp", None, "idle")]
    assert [w.get("output") for w in s["workers"]] == [False, True, None]
    assert s["workers"][1]["weight_bytes"] == 20 and s["workers"][1]["free"] == 200
    assert s["links"] == [{"src": "a:1", "dst": "b:2", "push": False, "reason": "llama.cpp's worker", "relayed": None,
                           "bytes_per_token": None, "rtt_src": None, "rtt_dst": None}]  # no telemetry: not measured
    assert s["slots"] == [{"id": 0, "busy": False}, {"id": 1, "busy": True}]
    assert (s["queue"], s["processing"], s["metrics"]["tokens_predicted"], s["draft"]) == (3, 1, 5, None)


def test_snapshot_reads_the_hooks_when_present():
    s = pipeline_view.snapshot(service(worker_states={"b:2": "lost"}, draft_stats={"drafted": 8, "accepted": 6}))
    assert [w["state"] for w in s["workers"]] == ["up", "lost", "idle"]
    assert s["draft"] == {"drafted": 8, "accepted": 6}


def test_snapshot_before_loading():
    s = pipeline_view.snapshot(NS(name="m.gguf", engine=None))
    assert s["loaded"] is False and s["workers"] == []


def test_snapshot_shows_the_engines_telemetry():
    telemetry = Telemetry()
    now = 1000.0
    telemetry._probes = {"a:1": Probe(0.002, 60, 100, now - 1), "b:2": Probe(0.004, 150, 300, now - 1)}
    for end, n in ((now - 0.2, 2), (now - 0.1, 2)):
        telemetry.add(StepTime("waves", end, 0.05, n, (StageTime("a:1", 0.001, 0.02, 100, 1160),
                                                      StageTime("b:2", 0.0, 0.03, 1200, 400))))
    s = pipeline_view.snapshot(service(telemetry=telemetry))
    a, b, idle = s["workers"]
    assert (a["free"], a["free_now"], a["total"], a["rtt"]) == (100, 60, 100, 0.002)  # placed, then as probed
    assert (b["free_now"], b["sent_per_token"], b["received_per_token"]) == (150, 600, 200)
    assert (a["wait"], a["busy"]) == (0.001, 0.02) and "rtt" not in idle
    (link,) = s["links"]
    assert link["relayed"] is True and link["bytes_per_token"] == 1160 / 2  # a:1's reply per token
    assert (link["rtt_src"], link["rtt_dst"]) == (0.002, 0.004)
    assert [step["n_tokens"] for step in s["timeline"]] == [2, 2] and s["throughput"] > 0


def test_snapshot_without_steps_leaves_the_measures_empty():
    s = pipeline_view.snapshot(service(telemetry=Telemetry()))
    assert s["workers"][0]["rtt"] is None and s["links"][0]["bytes_per_token"] is None
    assert s["links"][0]["relayed"] is None and s["timeline"] == [] and s["throughput"] is None
