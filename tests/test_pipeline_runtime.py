"""Pipeline engine against single-process training: one process, then 2 and 4 ranks."""

import copy

import pytest
import torch
import torch.nn as nn
from mp_pool import run_ranks

import dist_kernels as dk

SEED = 20261130
STEPS = 3
BATCH = 8
WIDTH = 6


def _model(n_layers: int, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(SEED)
    layers = []
    for _ in range(n_layers):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).to(dtype)


def _batches(steps: int, batch: int, dtype: torch.dtype = torch.float64):
    gen = torch.Generator().manual_seed(SEED + 1)
    return [
        (
            torch.randn(batch, WIDTH, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(batch, WIDTH, generator=gen, dtype=torch.float64).to(dtype),
        )
        for _ in range(steps)
    ]


def _reference(model: nn.Sequential, batches) -> list:
    """Plain single-process SGD on whole batches: the result the pipeline must reproduce."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_pipeline(pipe, model, batches) -> list:
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        losses.append(pipe.step(x, y).item())
        opt.step()
    return losses


def _max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_one_rank_equals_plain_training(schedule):
    print("seed", SEED)
    reference, piped = _model(4), _model(4)
    batches = _batches(STEPS, BATCH)
    ref_losses = _reference(reference, batches)
    pipe = dk.Pipeline(piped, n_microbatches=4, schedule=schedule, loss_fn=nn.functional.mse_loss)
    losses = _train_pipeline(pipe, piped, batches)
    diff = _max_param_diff(reference, piped)
    print(schedule, "max parameter difference", diff)
    assert diff < 1e-12
    assert losses == pytest.approx(ref_losses, abs=1e-12)


class _Penalized(nn.Module):
    """A Linear that keeps a penalty on its output, as an MoE layer keeps its aux loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.penalty = None

    def forward(self, x):
        y = self.linear(x)
        self.penalty = 0.1 * y.square().mean()
        return torch.tanh(y)


def _penalty_of(stage: nn.Module):
    found = [m.penalty for m in stage.modules() if isinstance(m, _Penalized)]
    return torch.stack(found).sum() if found else None


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_stage_loss_is_backpropagated_from_its_stage(schedule):
    """stage_loss: each stage's penalties join the micro-batch's loss where they arise (on one
    rank, interleaved 1F1B runs two stages: the first backpropagates its own as a second
    root). Against plain autograd of mean over micro-batches of (mse + every penalty)."""
    print("seed", SEED)
    torch.manual_seed(SEED)
    reference = nn.Sequential(*(_Penalized() for _ in range(4))).double()
    piped, plain = copy.deepcopy(reference), copy.deepcopy(reference)
    batches = _batches(STEPS, BATCH)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = []
    for x, y in batches:
        ref_opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(4), y.chunk(4)):
            loss = nn.functional.mse_loss(reference(xm), ym) + _penalty_of(reference)
            (loss / 4).backward()
            total += loss.item() / 4
        ref_opt.step()
        ref_losses.append(total)
    pipe = dk.Pipeline(
        piped,
        n_microbatches=4,
        schedule=schedule,
        loss_fn=nn.functional.mse_loss,
        stage_loss=_penalty_of,
    )
    assert pipe.n_stages == (2 if schedule == "interleaved-1f1b" else 1)
    losses = _train_pipeline(pipe, piped, batches)
    diff = _max_param_diff(reference, piped)
    print(schedule, "max parameter difference", diff)
    assert diff < 1e-12
    assert losses == pytest.approx(ref_losses, abs=1e-12)
    # without the stage losses the run is another one: the check can fail
    _train_pipeline(dk.Pipeline(plain, n_microbatches=4, loss_fn=nn.functional.mse_loss), plain,
                    batches)  # fmt: skip
    assert _max_param_diff(plain, piped) > 1e-6


def test_stage_loss_must_be_a_scalar():
    torch.manual_seed(SEED)
    model = nn.Sequential(_Penalized()).double()
    pipe = dk.Pipeline(
        model, n_microbatches=2, loss_fn=nn.functional.mse_loss,
        stage_loss=lambda stage: torch.ones(2, dtype=torch.float64),
    )  # fmt: skip
    x, y = _batches(1, 4)[0]
    with pytest.raises(dk.pipeline.PipelineError, match=r"stage_loss of stage 0 must return a "):
        pipe.step(x, y)
    with pytest.raises(TypeError, match=r"stage_loss must be callable, got int"):
        dk.Pipeline(model, n_microbatches=2, loss_fn=nn.functional.mse_loss, stage_loss=3)


def test_one_rank_checkpointing_stores_less():
    batches = _batches(1, BATCH)
    saved = {}
    for ckpt in (False, True):
        model = _model(4)
        pipe = dk.Pipeline(
            model,
            n_microbatches=2,
            schedule="interleaved-1f1b",
            loss_fn=nn.functional.mse_loss,
            checkpoint_activations=ckpt,
        )
        _train_pipeline(pipe, model, batches)
        saved[ckpt] = dict(pipe.stats)
    print("stored activations without / with checkpointing", saved)
    assert saved[True]["peak_saved_bytes"] < saved[False]["peak_saved_bytes"]
    assert saved[True]["saved_tensors"] < saved[False]["saved_tensors"]


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="does not split into n_microbatches=3"):
        dk.Pipeline(_model(2), n_microbatches=3, loss_fn=nn.functional.mse_loss).step(
            *_batches(1, BATCH)[0]
        )
    with pytest.raises(ValueError, match="2 stages given; the 1f1b schedule on 1 ranks needs 1"):
        dk.Pipeline([nn.Linear(2, 2)] * 2, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        dk.Pipeline(_model(2), n_microbatches=2, loss_fn=None)
    with pytest.raises(ValueError, match="targets: required on the last stage"):
        dk.Pipeline(_model(2), n_microbatches=2, loss_fn=nn.functional.mse_loss).step(
            torch.zeros(4, WIDTH, dtype=torch.float64)
        )


def test_stage_failure_names_stage_action_and_microbatch():
    class Boom(nn.Module):
        def forward(self, x):
            if x.shape[0] and x[0, 0] > 100:
                raise ValueError("boom")
            return x

    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Boom()).double()
    pipe = dk.Pipeline(model, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    x, y = _batches(1, 4)[0]
    x[2, 0] = 1e6  # micro-batch 1 only; the Linear keeps it large
    model[0].weight.data = torch.eye(WIDTH, dtype=torch.float64)
    model[0].bias.data.zero_()
    with pytest.raises(
        dk.pipeline.PipelineError, match=r"stage 0 .*forward of stage 0, micro-batch 1.*boom"
    ):
        pipe.step(x, y)
    with pytest.raises(dk.pipeline.PipelineError, match="failed earlier"):
        pipe.step(x, y)


# ----------------------------------------------------------------------------- several ranks


def _make_comm(group=None):
    return dk.Communicator(group=group)


def _rank_cases(cases):
    """Runs every (schedule, layers, checkpoint) case on this rank; returns the measurements."""
    import torch.distributed as dist

    comm = _make_comm()
    out = []
    for schedule, n_layers, ckpt in cases:
        reference, model = _model(n_layers), _model(n_layers)
        batches = _batches(STEPS, BATCH)
        ref_losses = _reference(reference, batches)
        pipe = dk.Pipeline(
            model,
            comm,
            n_microbatches=4,
            schedule=schedule,
            loss_fn=nn.functional.mse_loss,
            checkpoint_activations=ckpt,
            print_partition=False,
        )
        losses = _train_pipeline(pipe, model, batches)
        mine = [i for i, _ in enumerate(model) if any(_owns(pipe, model[i]))]
        diff = max(_max_param_diff(reference[i], model[i]) for i in mine)
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        out.append((dist.get_rank(), schedule, ckpt, diff, loss_diff, dict(pipe.stats)))
    return out


def _owns(pipe, layer):
    ids = {id(p) for p in pipe.parameters()}
    return [id(p) in ids for p in layer.parameters()]


CASES = [(s, 8, False) for s in ("gpipe", "1f1b", "interleaved-1f1b")] + [
    ("1f1b", 8, True),
    ("interleaved-1f1b", 8, True),
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_equals_single_process(world_size):
    print("seed", SEED)
    results = [r for rank in run_ranks(world_size, _rank_cases, CASES, timeout=240) for r in rank]
    for rank, schedule, ckpt, diff, loss_diff, stats in results:
        print(
            f"rank {rank} {schedule:17s} checkpoint={ckpt!s:5s} max parameter difference "
            f"{diff:.1e}, loss difference {loss_diff:.1e}, {stats}"
        )
        assert diff < 1e-12 and loss_diff < 1e-12
    peak = {(r, s, c): st["peak_saved_bytes"] for r, s, c, _, _, st in results}
    for rank in range(world_size):
        for schedule in ("1f1b", "interleaved-1f1b"):
            assert peak[(rank, schedule, True)] < peak[(rank, schedule, False)], (rank, schedule)


def _grads_in_ddp_buckets(pipe, steps: int) -> bool:
    """Every owned parameter's .grad lies inside a bucket of its stage's DDP (DDP reduced it),
    and each DDP launched its buckets once per step (only the stage's last backward reduced)."""
    trainable = [s for s, m in pipe.stages.items() if list(m.parameters())]
    if sorted(pipe.ddp) != sorted(trainable) or hasattr(pipe, "_dp_sync"):
        return False
    for stage in trainable:
        module = pipe.stages[stage]
        ddp = pipe.ddp[stage]
        if not isinstance(ddp, dk.DistributedDataParallel) or ddp.module is not module:
            return False
        if ddp.reductions_launched != steps * len(ddp.bucket_layouts):
            return False
        spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in ddp.buckets]
        for p in module.parameters():
            if not any(lo <= p.grad.data_ptr() < hi for lo, hi in spans):
                return False
    return True


def _rank_hybrid(cases):
    import torch.distributed as dist

    mesh = dk.ProcessMesh(dp=2, pp=2, communicator_factory=_make_comm)
    out = []
    for schedule, ckpt, balance in cases:
        # FP32: DDP buckets hold FP32/FP16/BF16 gradients, not FP64.
        reference, model = _model(4, torch.float32), _model(4, torch.float32)
        batches = _batches(STEPS, 2 * BATCH, torch.float32)
        ref_losses = _reference(reference, batches)
        half = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)
        mine = [(x[half], y[half]) for x, y in batches]
        pipe = dk.Pipeline(
            model,
            mesh,
            n_microbatches=4,
            schedule=schedule,
            loss_fn=nn.functional.mse_loss,
            checkpoint_activations=ckpt,
            balance=balance,
            print_partition=False,
        )
        losses = _train_pipeline(pipe, model, mine)
        owned = [i for i, _ in enumerate(model) if any(_owns(pipe, model[i]))]
        diff = max(_max_param_diff(reference[i], model[i]) for i in owned)
        by_ddp = _grads_in_ddp_buckets(pipe, STEPS)
        name = schedule + (" checkpointed" if ckpt else "") + (f" {balance}" if balance else "")
        out.append((dist.get_rank(), name, repr(mesh), diff, losses, ref_losses, by_ddp))
    return out


HYBRID = [(s, False, None) for s in ("gpipe", "1f1b", "interleaved-1f1b")] + [
    ("1f1b", True, None),
    ("interleaved-1f1b", True, None),
    ("interleaved-1f1b", False, [1, 1, 3, 3]),  # stage 1 is a lone Tanh: nothing to wrap
]


def test_data_times_pipeline_equals_single_process():
    print("seed", SEED)
    results = run_ranks(4, _rank_hybrid, HYBRID, timeout=180)
    for per_rank in results:
        for rank, schedule, mesh, diff, _, _, by_ddp in per_rank:
            print(
                f"rank {rank} {schedule} {mesh}: max parameter difference {diff:.1e}, DDP {by_ddp}"
            )
            # FP32 rounding only (micro-batch sums in another order); a missing or doubled
            # reduction moves parameters by ~6e-3 here.
            assert diff < 1e-5
            assert by_ddp, (rank, schedule)  # each stage wrapped; its DDP wrote the .grad
    # Each replica's loss is its half of the batch; their mean is the whole batch's.
    for i, _ in enumerate(HYBRID):
        for step in range(STEPS):
            # rank = dp_rank * pp + pp_rank (ProcessMesh): ranks 0 and 2 are the two replicas
            replicas = [results[r][i][4][step] for r in (0, 2)]
            assert sum(replicas) / 2 == pytest.approx(results[0][i][5][step], abs=1e-5)


def _rank_mesh_errors_and_default_comm():
    with pytest.raises(ValueError, match=r"dp\(2\) x pp\(3\) != world_size\(4\)"):
        dk.ProcessMesh(dp=2, pp=3, communicator_factory=_make_comm)
    with pytest.raises(ValueError, match=r"world_size\(4\) is not a multiple of pp\(3\)"):
        dk.ProcessMesh(pp=3, communicator_factory=_make_comm)
    mesh = dk.ProcessMesh(pp=4, communicator_factory=_make_comm)
    # comm=None: the pipeline makes its own Communicator over the default group.
    reference, model = _model(4), _model(4)
    batches = _batches(1, BATCH)
    ref_loss = _reference(reference, batches)[0]
    pipe = dk.Pipeline(model, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    loss = pipe.step(*batches[0]).item()
    pipe.comm.close()
    return mesh.dp, mesh.pp, mesh.pp_rank, mesh.pp_ranks, pipe.rank, abs(loss - ref_loss)


def test_mesh_layout_errors_and_default_comm():
    results = run_ranks(4, _rank_mesh_errors_and_default_comm)
    for rank, (dp, pp, pp_rank, pp_ranks, pipe_rank, loss_diff) in enumerate(results):
        assert (dp, pp, pp_rank, pp_ranks, pipe_rank) == (1, 4, rank, [0, 1, 2, 3], rank)
        assert loss_diff < 1e-12


class _Gate(nn.Module):
    """Stage 0: a Linear, then its output with a boolean mask and integer ids (a tuple)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH).double()

    def forward(self, x):
        h = self.fc(x)
        return h, h > 0, torch.arange(h.shape[0], dtype=torch.int16)


class _Masked(nn.Module):
    """Stage 1: takes the tuple apart."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH).double()

    def forward(self, h, mask, ids):
        return self.fc(h * mask) + ids.unsqueeze(1).double()


def _rank_tuples_and_changing_shapes():
    torch.manual_seed(SEED)
    stages = [_Gate(), _Masked()]
    reference = copy.deepcopy(stages)
    batches = _batches(2, BATCH) + _batches(1, BATCH // 2)  # micro-batch shape changes
    opt = torch.optim.SGD([p for s in reference for p in s.parameters()], lr=0.1)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = sum(
            nn.functional.mse_loss(reference[1](*reference[0](xm)), ym) / 2
            for xm, ym in zip(x.chunk(2), y.chunk(2))
        )
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    pipe = dk.Pipeline(
        stages,
        _make_comm(),
        n_microbatches=2,
        loss_fn=nn.functional.mse_loss,
        print_partition=False,
    )
    losses = _train_pipeline(pipe, None, batches)
    mine = pipe.rank
    return _max_param_diff(reference[mine], stages[mine]), losses, ref_losses


def test_tuple_activations_and_changing_shapes():
    for rank, (diff, losses, ref_losses) in enumerate(
        run_ranks(2, _rank_tuples_and_changing_shapes, timeout=120)
    ):
        print(f"rank {rank}: max parameter difference {diff:.1e}")
        assert diff < 1e-12
        assert losses == pytest.approx(ref_losses, abs=1e-12)


class _FailOn(nn.Module):
    """Identity that raises on one micro-batch (marked by a huge first element)."""

    def forward(self, x):
        if x[0, 0] > 1e5:
            raise ValueError("injected failure")
        return x


def _rank_stage_failure(evaluate: bool = False):
    import datetime

    comm = dk.Communicator(timeout=datetime.timedelta(seconds=10))
    model = nn.Sequential(nn.Identity(), nn.Identity(), _FailOn(), nn.Identity())
    pipe = dk.Pipeline(
        model,
        comm,
        n_microbatches=4,
        loss_fn=nn.functional.mse_loss,
        print_partition=False,
        balance=[1, 1, 1, 1],
    )
    x, y = _batches(1, BATCH)[0]
    x[2, 0] = 1e6  # micro-batch 1
    try:
        pipe.evaluate(x, y) if evaluate else pipe.step(x, y)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("evaluate", [False, True], ids=["step", "evaluate"])
def test_failing_stage_makes_every_rank_raise(evaluate):
    results = run_ranks(4, _rank_stage_failure, evaluate, timeout=90)
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
        assert result is not None, f"rank {rank} did not raise"
    name, message = results[2]
    assert name == "PipelineError"
    assert "stage 2" in message and "forward of stage 2, micro-batch 1" in message
    assert ("evaluation" in message) == evaluate
    assert "injected failure" in message
    for rank in (0, 1, 3):
        assert f"pipeline stage {rank}" in results[rank][1]


# ----------------------------------------------------------------------------- evaluate


class _Dropping(nn.Module):
    """Dropout after a Linear: eval mode must switch it off (and evaluate put train back)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.drop = nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.tanh(self.linear(x)))


def _rank_evaluate(schedule: str, n_stages_per_rank: int):
    """evaluate() on this rank's pipeline against the whole model's eval-mode forward; and
    what it leaves: no gradient, the stages back in train mode."""
    torch.manual_seed(SEED)
    reference = nn.Sequential(*(_Dropping() for _ in range(4))).double()
    model = copy.deepcopy(reference)
    comm = _make_comm()
    pipe = dk.Pipeline(model, comm, n_microbatches=4, schedule=schedule,
                       loss_fn=nn.functional.mse_loss, print_partition=False)  # fmt: skip
    assert pipe.n_stages == n_stages_per_rank * comm.world_size
    x, y = _batches(1, BATCH)[0]
    got = pipe.evaluate(x, y).item()
    l1 = pipe.evaluate(x, y, loss_fn=nn.functional.l1_loss).item()
    reference.eval()
    with torch.no_grad():
        want = nn.functional.mse_loss(reference(x), y).item()
        want_l1 = nn.functional.l1_loss(reference(x), y).item()
    untouched = all(p.grad is None for p in pipe.parameters())
    training = all(m.training for m in pipe.stage_module.modules())
    comm.close()
    return got, want, l1, want_l1, untouched, training


@pytest.mark.parametrize(
    "world_size,schedule,per_rank",
    [(1, "interleaved-1f1b", 2), (2, "1f1b", 1), (2, "zb-v", 2), (4, "1f1b", 1)],
)
def test_evaluate_equals_the_whole_models_eval_forward(world_size, schedule, per_rank):
    """Forward-only evaluation, every stage on its rank (a V: rank 0 holds the first and the
    last stage): the loss (the pipeline's, or another loss_fn) equals the whole model's in
    eval mode (dropout off) on every rank; no gradient is left and train mode is restored."""
    print("seed", SEED)
    for got, want, l1, want_l1, untouched, training in run_ranks(
        world_size, _rank_evaluate, schedule, per_rank, timeout=120
    ):
        assert got == pytest.approx(want, abs=1e-12) and l1 == pytest.approx(want_l1, abs=1e-12)
        assert untouched and training
