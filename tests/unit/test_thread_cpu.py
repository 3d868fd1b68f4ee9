"""benchmarks.thread_cpu: a thread's CPU seconds are read from /proc and attributed to its kind."""

import sys
import threading
import time

import pytest

from benchmarks.thread_cpu import report, thread_cpu_s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task is Linux's")
def test_a_busy_thread_is_counted_and_the_caller_is_main():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    before = thread_cpu_s()
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.5)
    during = thread_cpu_s()
    stop.set()
    t.join()
    new = [cpu for tid, (kind, cpu) in during.items() if tid not in before and kind == "python"]
    assert new and max(new) >= 0.1  # the spinning thread, CPU-bound for 0.5 s on a shared core at least a fifth
    assert [k for k, _ in during.values()].count("main") == 1


def test_report_gives_ratios_against_ddp():
    phases = {"forward": 0.05, "backward": 0.1, "clip": 0.01, "optimizer": 0.04}
    summary = {"ddp": {"step_s": 0.2, "cpu_total_s": 0.4, "cpu_s": {"main": 0.3, "gloo_tcp_loop": 0.1},
                       "phase_s": phases},
               "sf-outer2": {"step_s": 0.25, "cpu_total_s": 0.5, "cpu_s": {"main": 0.35, "python": 0.15},
                             "phase_s": dict(phases, backward=0.15)}}
    text = report({"summary": summary, "env": {},
                   "config": {"name": "x", "regime": "comm", "reshard": "after_backward", "rounds": 1, "warmup": 1,
                              "steps": 2}})
    row = next(line for line in text.splitlines() if line.startswith("| sf-outer2"))
    assert "| 250.0 | 1.250 | 500.0 | 1.250 | 350.0 | 0.0 | 150.0 |" in row  # main, gloo_tcp_loop, python
    phase_rows = [line for line in text.splitlines() if line.startswith("| sf-outer2 |")]
    assert phase_rows[-1] == "| sf-outer2 | 50.0 | 150.0 | 10.0 | 40.0 |"  # the training thread by phase, ms
