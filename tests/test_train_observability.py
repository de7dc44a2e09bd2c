"""The training driver's views of a run: --tensorboard scalars (read back with tensorboard's
own event reader), --profile-steps traces (torch.profiler with our collectives, merged over
ranks), and Megatron's min/max-by-rank line.

One 2-rank run of the tiny model does both; its records (the driver's JSON metrics) are the
reference for the scalars.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mp_pool import run_ranks

from dist_kernels.models import GPTConfig
from dist_kernels.train import ConfigError, TrainConfig, train
from dist_kernels.train.stragglers import minmax_line
from dist_kernels.train.tensorboard import scalars

TINY = GPTConfig(n_layers=1, n_heads=2, dim=32, block_size=16, tie_embeddings=False)


def _train(cfg: TrainConfig):
    import torch.distributed as dist

    result = train(cfg.with_layout(dist.get_world_size()))
    return result.records, result.evals, result.test


def test_tensorboard_scalars_and_profiled_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, profile = str(tmp_path / "tb"), str(tmp_path / "prof")
    cfg = TrainConfig(
        model=TINY, steps=4, micro_batch=2, dp=2, seed=7, progress=False,
        tensorboard=board, profile_steps=(2, 3), profile_dir=profile, clip_grad=1.0,
        eval_interval=2, test_fraction=0.02,
    )  # fmt: skip
    (records, evals, test), _ = run_ranks(2, _train, cfg, timeout=600)
    events = EventAccumulator(board)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    held_out = {"valid/loss", "valid/ppl", "test/loss", "test/ppl"}
    assert tags == set(scalars(records[0])) | held_out
    for key in ("loss", "ppl"):
        got = [(e.step, e.value) for e in events.Scalars(f"valid/{key}")]
        assert got == [(r["step"], float(np.float32(r[f"valid_{key}"]))) for r in evals], key
        got = [(e.step, e.value) for e in events.Scalars(f"test/{key}")]
        assert got == [(4, float(np.float32(test[f"test_{key}"])))], key
    assert [r["step"] for r in evals] == [2, 4]
    assert {
        "loss",
        "lr",
        "throughput/tokens_per_s",
        "mfu",
        "time/comm_ms",
        "memory/peak_mb",
        "grad_norm",
    } <= tags
    for tag in ("loss", "lr", "throughput/tokens_per_s", "time/backward_ms", "grad_norm"):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        # TensorBoard stores float32: the record's value rounded once
        want = [(r["step"], float(np.float32(scalars(r)[tag]))) for r in records]
        assert got == want, tag
    for rank in range(2):
        with open(os.path.join(profile, f"rank{rank}.pt.trace.json")) as f:
            trace = json.load(f)["traceEvents"]
        comms = [e for e in trace if e.get("name") == "record_param_comms"]
        assert comms and all(e["args"]["Group size"] == 2 for e in comms)
        assert {e["args"]["Collective name"] for e in comms} >= {"allreduce"}
        assert [e for e in trace if e.get("cat") == "dk_comm"]
    with open(os.path.join(profile, "merged.json")) as f:
        merged = json.load(f)["traceEvents"]
    assert {e["pid"] for e in merged if e.get("name") == "record_param_comms"} == {0, 1}


def test_minmax_line_names_the_extreme_ranks():
    line = minmax_line(10, {"Rtt": [41.2, 43.05, 42.0], "Busy": [30.0, 29.5, 44.0]})
    assert line == (
        "step 10 | MnRtt/Rnk: 41.20ms/0 | MxRtt/Rnk: 43.05ms/1 | "
        "MnBusy/Rnk: 29.50ms/1 | MxBusy/Rnk: 44.00ms/2"
    )


@pytest.mark.parametrize("steps", [(0, 2), (3, 2), (2, 9)])
def test_profile_steps_out_of_range(steps):
    with pytest.raises(
        ConfigError, match=r"profile_steps .* must satisfy 1 <= A <= B <= steps\(4\)"
    ):
        TrainConfig(model=TINY, steps=4, profile_steps=steps).check()
