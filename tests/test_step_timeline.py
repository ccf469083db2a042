"""benchmarks/step_timeline.py reads a profiler trace of captured steps: graph replays, the kernels launched
outside them, and the GPU's idle time, here on a trace written out by hand."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_timeline  # noqa: E402


def kernel(name: str, ts: float, dur: float, stream: int, correlation: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation}}


def trace(steps: int = 5, period: float = 1000.0) -> list[dict]:
    """Each step: the host launches 3 loose kernels (10 us each, 5 us apart) and then the graph (correlation
    100 + i): a 600-us kernel on stream 7 and beside it a 300-us one on stream 9, then a 100-us one on 7;
    the next step starts ``period`` us after this one."""
    events = []
    for i in range(steps):
        t = i * period
        for j in range(3):
            events.append(kernel("at::native::vectorized_elementwise_kernel", t + 15 * j, 10, 7, 10 * i + j))
        g = t + 50
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": g - 2000, "dur": 40,
                       "args": {"correlation": 100 + i}})
        events += [kernel("_conv_rows_fwd_kernel", g, 600, 7, 100 + i),
                   kernel("sm90_xmma_wgrad_indexed", g + 100, 300, 9, 100 + i),
                   kernel("multi_tensor_apply_kernel", g + 600, 100, 7, 100 + i)]
    return events


def test_the_summary_of_steps_written_by_hand(tmp_path):
    s = step_timeline.summarise(trace())
    assert s["replays"] == 3   # the first is skipped, the last has no end
    assert s["period_us"] == 1000 and s["graph_us"] == 700 and s["graph_kernels"] == 3
    assert s["outside_kernels"] == 3 and s["outside_span_us"] == 40
    # idle: 2 x 5 us between the loose kernels, 10 us before the graph, 250 us after it
    assert s["idle_us"] == pytest.approx(270) and s["longest_idle_us"] == pytest.approx(250)
    assert s["host_launch_us"] == 40 and s["host_lead_us"] == 2000
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": trace()}, f)
    text = step_timeline.report(step_timeline.load(path), width=350)
    assert "period 1000 us" in text and "the GPU is the bottleneck" in text
    assert "s7:  350 rows-fwdx1 | s9:  250 cudnn-wgradx1" in text


def test_a_kernel_outside_the_graph_during_a_replay_counts_as_busy():
    events = trace()
    for i in range(5):   # on another stream, from 50 us before each replay's end to 50 us after it
        events.append(kernel("at::native::reduce_kernel", i * 1000 + 700, 100, 11, 50 + i))
    s = step_timeline.summarise(events)
    assert s["idle_us"] == pytest.approx(220) and s["longest_idle_us"] == pytest.approx(200)


def test_a_trace_without_graph_replays_is_refused():
    with pytest.raises(SystemExit, match="CUDA graph replays"):
        step_timeline.summarise([kernel("k", 0, 1, 7, 1)])
