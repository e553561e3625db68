"""Each rank's own phase times for fleet health (pretrain/observe/step_times.py `split`/`window`): the forward is
carved out of the forward+backward lap, the laps' perf/* means are unchanged, and the window resets."""
import time

import torch

from pretrain.distributed import CollectiveTime
from pretrain.observe import StepTimes


def test_the_forward_is_carved_out_of_the_forward_backward_lap_and_perf_is_unchanged():
    times = StepTimes(torch.device("cpu"), micro_batches=1, pipeline=False)
    for _ in range(2):
        times.start()
        time.sleep(0.002)
        times.lap("data_wait")
        time.sleep(0.010)
        times.split("compute")
        time.sleep(0.020)
        times.lap("fwd_bwd")
        time.sleep(0.004)
        times.lap("optimizer")
        times.end()
    steps, fleet = times.window()
    perf = times.values()
    assert steps == 2 and set(fleet) == {"data_wait", "compute", "backward", "optimizer"}
    assert abs(fleet["compute"] + fleet["backward"] - perf["perf/fwd_bwd_s"]) < 1e-9
    assert fleet["compute"] >= 0.010 and fleet["backward"] >= 0.020 and fleet["compute"] < fleet["backward"]
    assert fleet["data_wait"] == perf["perf/data_wait_s"] and fleet["optimizer"] == perf["perf/optimizer_s"]
    assert times.window() == (0, {})


def test_collective_time_adds_wall_clock_laps_on_cpu_and_resets_when_taken():
    clock = CollectiveTime()
    start = clock.mark(torch.device("cpu"))
    time.sleep(0.005)
    clock.add(start, clock.mark(torch.device("cpu")))
    assert 0.005 <= clock.take() < 0.5 and clock.take() == 0.0
