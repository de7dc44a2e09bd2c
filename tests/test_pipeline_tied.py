"""A parameter shared by pipeline stages (a tied embedding and head) trains as the one tensor
of a single process: on one rank, across ranks, with two stages per rank and beside dp."""

import pytest
import torch
import torch.nn as nn
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels.pipeline import tied as tied_lib

SEED = 20261206
VOCAB, DIM, SEQ, BATCH, STEPS = 11, 6, 5, 8, 3


class _Head(nn.Module):
    """The output layer: logits ``[batch, seq, vocab]``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        return self.proj(x)


def _model(n_blocks: int, dtype=torch.float64) -> nn.Sequential:
    """Embedding, ``n_blocks`` x (Linear, Tanh), head whose weight is the embedding's."""
    torch.manual_seed(SEED)
    layers = [nn.Embedding(VOCAB, DIM)]
    for _ in range(n_blocks):
        layers += [nn.Linear(DIM, DIM), nn.Tanh()]
    head = _Head()
    head.proj.weight = layers[0].weight
    return nn.Sequential(*layers, head).to(dtype)


def _loss(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _batches(batch: int = BATCH):
    gen = torch.Generator().manual_seed(SEED + 1)
    return [
        (
            torch.randint(VOCAB, (batch, SEQ), generator=gen),
            torch.randint(VOCAB, (batch, SEQ), generator=gen),
        )
        for _ in range(STEPS)
    ]


def _reference(model: nn.Module, batches):
    """Plain single-process SGD: autograd adds both uses into the one tied tensor."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train(pipe, batches):
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        losses.append(pipe.step(x, y).item())
        opt.step()
    return losses


def _stage_params(pipe):
    """This rank's parameters under ``stage.name``."""
    return {f"{s}.{n}": p.detach().clone() for s, m in pipe.stages.items()
            for n, p in m.named_parameters()}  # fmt: skip


def test_find_and_untie_give_each_stage_its_copy():
    model = _model(1)
    stages = [model[:1], model[1:3], model[3:]]
    assert tied_lib.find_tied(stages) == [[(0, "0.weight"), (2, "3.proj.weight")]]
    tied = tied_lib.untie(stages, mine=[0, 2])  # one rank holds the first and the last stage
    (t,) = tied
    first, last = t.local[0], t.local[2]
    assert first is model[0].weight and last is model[3].proj.weight and first is not last
    assert torch.equal(first, last)
    assert not tied_lib.is_tied_copy(first) and tied_lib.is_tied_copy(last)
    assert t.describe() == "stage 0 '0.weight', stage 2 '3.proj.weight'"
    # a rank with the last stage only keeps the tensor it has and marks it a copy
    other = _model(1)
    kept = other[3].proj.weight
    (t,) = tied_lib.untie([other[:1], other[1:3], other[3:]], mine=[2])
    assert t.local == {2: kept} and tied_lib.is_tied_copy(kept)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-v"])
def test_one_rank_equals_the_tied_model(schedule):
    """Every stage on one rank: the copies' gradients are added locally each step."""
    print("seed", SEED)
    reference, model = _model(4), _model(4)
    batches = _batches()
    ref_losses = _reference(reference, batches)
    pipe = dk.Pipeline(model, n_microbatches=4, schedule=schedule, loss_fn=_loss,
                       print_partition=False)  # fmt: skip
    losses = _train(pipe, batches)
    assert losses == pytest.approx(ref_losses, abs=1e-12)
    copies = [t.local[s] for t in pipe.tied for s in t.stages]
    if pipe.n_stages == 1:  # one stage holds both uses: the one tensor stays
        assert copies == [] and model[-1].proj.weight is model[0].weight
        return
    assert len(copies) == 2 and copies[0] is not copies[1]
    for copy in copies:
        torch.testing.assert_close(copy, reference[0].weight, rtol=0, atol=1e-12)


def _make_comm(group=None):
    return dk.Communicator(group=group)


def _rank_tied(cases, dp: int):
    """Each (schedule, blocks) case against the single-process tied model; returns per case
    the losses' and parameters' largest differences and this rank's tied copies."""
    import torch.distributed as dist

    world = dist.get_world_size()
    mesh = dk.ProcessMesh(dp=dp, pp=world // dp, communicator_factory=_make_comm)
    dtype = torch.float64 if dp == 1 else torch.float32  # DDP buckets: FP32/FP16/BF16
    out = []
    for schedule, blocks in cases:
        reference, model = _model(blocks, dtype), _model(blocks, dtype)
        batches = _batches(BATCH * dp)
        ref_losses = _reference(reference, batches)
        share = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)
        mine = [(x[share], y[share]) for x, y in batches]
        pipe = dk.Pipeline(model, mesh, n_microbatches=4, schedule=schedule, loss_fn=_loss,
                           print_partition=False)  # fmt: skip
        losses = _train(pipe, mine)
        if dp > 1:  # each replica's loss is its share's: average them
            losses = [float(v) for v in _mean_over(mesh.dp_comm, losses)]
        ref_named = dict(reference.named_parameters(remove_duplicate=False))
        diff = max(
            (p - ref_named[name.split(".", 1)[1]]).abs().max().item()
            for name, p in _stage_params(pipe).items()
        )
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        copies = {s: p.detach().clone() for t in pipe.tied for s, p in t.local.items()}
        out.append((dist.get_rank(), schedule, diff, loss_diff, copies))
    return out


def _mean_over(comm, values):
    t = torch.tensor(values, dtype=torch.float64)
    comm.all_reduce(t)
    return (t / comm.world_size).tolist()


CASES = [("1f1b", 2), ("zb-h1", 2), ("interleaved-1f1b", 4), ("zb-v", 4), ("dualpipe-v", 4)]


@pytest.mark.parametrize("world,dp", [(2, 1), (4, 1), (4, 2)], ids=["pp2", "pp4", "dp2xpp2"])
def test_pipeline_of_a_tied_model_equals_one_process(world, dp):
    """The embedding on the first stage, the head on the last (another rank, or the same
    rank in a V): losses and every parameter equal the single process's (float64 to 1e-12;
    beside dp FP32 rounding), and the holders' copies stay bitwise equal."""
    print("seed", SEED)
    cases = CASES if world == 2 else [c for c in CASES if c[0] in ("1f1b", "interleaved-1f1b")]
    results = run_ranks(world, _rank_tied, cases, dp, timeout=240)
    bound = 1e-12 if dp == 1 else 1e-5
    for i, (schedule, _) in enumerate(cases):
        copies = []
        for per_rank in results:
            rank, name, diff, loss_diff, mine = per_rank[i]
            print(f"rank {rank} {name}: parameters {diff:.1e}, losses {loss_diff:.1e}")
            assert diff < bound and loss_diff < bound, (rank, name)
            copies += list(mine.values())
        assert len(copies) == 2 * dp, (schedule, len(copies))
        for copy in copies[1:]:
            assert torch.equal(copy, copies[0]), schedule


def _rank_seeded_apart():
    """Each rank's model initialised apart (a script seeding by rank): the copies of the
    tied parameter, as the pipeline holds them after it is built."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _model(4)
    with torch.no_grad():  # another initialisation on every rank but 0
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank),
                               dtype=p.dtype) * rank)  # fmt: skip
    ours = model[0].weight.detach().clone()
    pipe = dk.Pipeline(model, _make_comm(), n_microbatches=4, loss_fn=_loss,
                       print_partition=False)  # fmt: skip
    (t,) = pipe.tied
    return ours, {s: p.detach().clone() for s, p in t.local.items()}


def test_copies_start_as_the_first_stages_when_ranks_seeded_apart():
    """Megatron's first-stage sync: the last stage's copy takes the first stage's values."""
    (ours0, first), (ours1, last) = run_ranks(2, _rank_seeded_apart, timeout=120)
    assert not torch.equal(ours0, ours1)  # the ranks did start apart
    assert list(first) == [0] and list(last) == [1]
    assert torch.equal(first[0], ours0) and torch.equal(last[1], ours0)


def _rank_untied_stays_apart():
    """The same model with an untied head: the exchange is not run (nothing shared)."""
    model = _model(2)
    model[-1].proj.weight = nn.Parameter(model[0].weight.detach().clone())
    comm = _make_comm()
    pipe = dk.Pipeline(model, comm, n_microbatches=2, loss_fn=_loss, print_partition=False)
    x, y = _batches()[0]
    pipe.step(x, y)
    return pipe.tied


def test_an_untied_model_has_nothing_to_exchange():
    assert run_ranks(2, _rank_untied_stays_apart, timeout=120) == [[], []]
