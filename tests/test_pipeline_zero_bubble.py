"""Zero-bubble schedules on the runtime: the same training as 1F1B, bit for bit.

Every schedule computes each micro-batch's gradients with the same ATen calls (the generic B/W
split restarts autograd where the two halves meet; the Linear path, taken by stages of plain
nn.Linear, makes AddmmBackward's matmuls itself, adding into a held .grad in the same GEMM,
which keeps the bits at these micro-batches of a few rows) and accumulates a parameter's
gradient over micro-batches in micro-batch order, as 1F1B does; the loss is the same mean. So
losses, gradients and updated parameters must be bitwise equal to 1F1B's, at 2 and 4 stages,
4, 8 and 16 micro-batches, and with data parallelism beside (dp = 2: the two replicas' gradients
summed in the same pairs, whatever the bucket layout). Layers are compared by their index in
the model, wherever the schedule put them (V schedules cut the model into twice the stages).
"""

import pytest
import torch
import torch.nn as nn
from mp_pool import run_ranks

import dist_kernels as dk

SEED = 20261202
LAYERS = 8  # Linear + Tanh pairs: 16 children, enough for 8 stages
WIDTH = 6
BATCH = 32
STEPS = 2
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v")
MICROBATCHES = (4, 8, 16)


class _Generic(nn.Linear):
    """Not a plain nn.Linear (a subclass may change forward): its stages take the generic
    split (``pipeline/split.py``), those of plain Linears the Linear path."""


def _model(kind: str = "linear") -> nn.Sequential:
    torch.manual_seed(SEED)
    linear = nn.Linear if kind == "linear" else _Generic
    layers = []
    for _ in range(LAYERS):
        layers += [linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _batches(replicas: int):
    gen = torch.Generator().manual_seed(SEED + 1)
    shape = (STEPS, replicas * BATCH, WIDTH)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _train(comm, schedule: str, m: int, replica: int, replicas: int, kind: str):
    """Two SGD steps; per owned layer index: (weight, bias, their grads of the last step)."""
    model = _model(kind)
    pipe = dk.Pipeline(
        model,
        comm,
        n_microbatches=m,
        schedule=schedule,
        loss_fn=nn.functional.mse_loss,
        print_partition=False,
    )
    split = {a.stage for a in pipe.actions if a.kind is dk.pipeline.Kind.BACKWARD_INPUT}
    assert sorted(pipe._deferred) == (sorted(split) if kind == "linear" else [])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    xs, ys = _batches(replicas)
    mine = slice(replica * BATCH, (replica + 1) * BATCH)
    losses, grads = [], {}
    owned = {id(p) for p in pipe.parameters()}
    layers = [i for i, layer in enumerate(model) if any(id(p) in owned for p in layer.parameters())]
    for x, y in zip(xs, ys):
        opt.zero_grad()
        losses.append(pipe.step(x[mine], y[mine]).item())
        grads = {i: [p.grad.clone() for p in model[i].parameters()] for i in layers}
        opt.step()
    params = {i: [p.detach().clone() for p in model[i].parameters()] for i in layers}
    for ddp in pipe.ddp.values():
        ddp.close()
    return losses, params, grads


def _rank_schedules(dp: int, kind: str):
    mesh = dk.ProcessMesh(dp=dp, pp=torch.distributed.get_world_size() // dp)
    out = {}
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            comm = mesh if dp > 1 else mesh.pp_comm
            try:
                out[(schedule, m)] = _train(comm, schedule, m, mesh.dp_rank, dp, kind)
            except ValueError as exc:  # dualpipe-v needs m >= 2 * pp
                out[(schedule, m)] = str(exc)
    mesh.close()
    return mesh.dp_rank, out


def _merged(results, key, replica):
    """One replica's losses, and every layer's parameters and gradients, gathered by index."""
    losses, params, grads = None, {}, {}
    for dp_rank, per_case in results:
        if dp_rank != replica:
            continue
        rank_losses, rank_params, rank_grads = per_case[key]
        losses = rank_losses if losses is None else losses
        assert losses == rank_losses  # every rank of a pipeline returns its replica's loss
        params.update(rank_params)
        grads.update(rank_grads)
    assert sorted(params) == list(range(0, 2 * LAYERS, 2)), sorted(params)
    return losses, params, grads


def _check_bitwise(results, dp: int, pp: int) -> None:
    for replica in range(dp):
        for m in MICROBATCHES:
            ref = _merged(results, ("1f1b", m), replica)
            for schedule in SCHEDULES[1:]:
                per_case = results[0][1][(schedule, m)]
                if isinstance(per_case, str):
                    assert schedule == "dualpipe-v" and m < 2 * pp, per_case
                    assert "needs n_microbatches" in per_case
                    continue
                losses, params, grads = _merged(results, (schedule, m), replica)
                print(f"dp {dp} pp {pp} m {m} {schedule}: losses {losses} (1f1b {ref[0]})")
                assert losses == ref[0], (schedule, m)
                for i in params:
                    for a, b in zip(params[i] + grads[i], ref[1][i] + ref[2][i]):
                        assert torch.equal(a, b), (schedule, m, i, (a - b).abs().max().item())


@pytest.mark.parametrize("kind", ["linear", "generic"])
@pytest.mark.parametrize("world_size,dp", [(2, 1), (4, 1), (4, 2)])
def test_zero_bubble_schedules_equal_1f1b_bitwise(world_size, dp, kind):
    """Both paths of the split (``kind``), with DDP over dp = 2 beside at 4 ranks."""
    print("seed", SEED)
    results = run_ranks(world_size, _rank_schedules, dp, kind, timeout=600)
    _check_bitwise(results, dp=dp, pp=world_size // dp)


class _Slow(nn.Module):
    """A Linear whose forward also sleeps: a stage of known minimum cost."""

    def __init__(self, seconds: float):
        super().__init__()
        self.fc, self.seconds = nn.Linear(WIDTH, WIDTH), seconds

    def forward(self, x):
        import time

        time.sleep(self.seconds)
        return self.fc(x)


SLEEP = 0.05


def _rank_profile():
    comm = dk.Communicator()
    out = {}
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(SEED)
        stages = [nn.Linear(WIDTH, WIDTH), _Slow(SLEEP)]
        pipe = dk.Pipeline(stages, comm, n_microbatches=2, schedule=schedule,
                           loss_fn=nn.functional.mse_loss, print_partition=False)  # fmt: skip
        x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
        out[schedule] = pipe.profile(x, y, steps=2)
    comm.close()
    return out


def test_profile_times_each_action_without_its_waits():
    """Stage 1 sleeps in every forward: its F is at least the sleep; stage 0's backward waits
    that long for each gradient, but the wait is not its time. The same table on both ranks,
    and the simulator takes it as it is."""
    results = run_ranks(2, _rank_profile, timeout=120)
    assert results[0] == results[1]
    for schedule, profile in results[0].items():
        times = profile["times"]
        print(schedule, profile)
        split = schedule == "zb-h1"
        keys = ["F", "send", "recv", "step"] + (["B", "W"] if split else ["BW"])
        assert sorted(times) == sorted(keys)
        assert times["F"][1] >= SLEEP
        backward = times["B"][0] + times["W"][0] if split else times["BW"][0]
        assert 0 < backward < SLEEP  # a one-Linear backward, its waits for gradients excluded
        assert profile["p2p"] > 0 and times["send"] > 0 and times["recv"] > 0
        # once per step: the loss broadcast at least, one latency and one receive
        assert times["step"] >= profile["p2p"] + times["recv"]
        sim = dk.pipeline.simulate(schedule, 2, 2, **profile)
        assert sim.step_time >= 2 * SLEEP
