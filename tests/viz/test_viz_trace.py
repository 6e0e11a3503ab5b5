"""The Chrome trace builder: tracks per rank, microsecond complete events, paired flow events."""

import json

from pipec.viz.trace import TraceEvent, TraceFlow, chrome_trace, write_trace


def test_tracks_events_and_flows(tmp_path):
    events = [TraceEvent(0, "0F0", "F", 0.0, 0.001), TraceEvent(1, "1F0", "F", 0.0025, 0.002, {"mb": 0})]
    flows = [TraceFlow(0, 0.001, 1, 0.0025)]
    path = write_trace(tmp_path / "t.json", events, flows, title="demo", ranks=[0, 1, 2])
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    evs = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in evs if e.get("name") == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}  # rank 2 has a track though it has no events
    complete = [e for e in evs if e["ph"] == "X"]
    assert [(e["tid"], e["name"], e["ts"], e["dur"]) for e in complete] == [
        (0, "0F0", 0.0, 1000.0),
        (1, "1F0", 2500.0, 2000.0),
    ]
    assert complete[1]["args"] == {"mb": 0}
    start = [e for e in evs if e["ph"] == "s"]
    finish = [e for e in evs if e["ph"] == "f"]
    assert len(start) == len(finish) == 1 and start[0]["id"] == finish[0]["id"]
    assert (start[0]["tid"], start[0]["ts"], finish[0]["tid"], finish[0]["ts"]) == (0, 1000.0, 1, 2500.0)


def test_empty_trace_is_valid_json():
    trace = chrome_trace([], title="empty")
    assert json.loads(json.dumps(trace))["traceEvents"][0]["args"]["name"] == "empty"
