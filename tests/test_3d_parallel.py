"""dp x tp x pp on one ProcessMesh trains like one process: the GPT, tensor-parallel inside
each pipeline stage, stage gradients averaged over dp by our DDP, micro-batches accumulated,
in FP32 and under bf16 autocast with FP32 master weights."""

from collections import OrderedDict

import pytest
import torch
from mp_pool import run_ranks
from test_gpt_tp import CONFIG, SEED, max_param_diff

import dist_kernels as dk
from dist_kernels.models import GPT, GPTConfig

STEPS = 3
SEQ = 8
MICROBATCHES = 2
PER_REPLICA = 4  # sequences per data-parallel replica per step


def _gpt():
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**CONFIG, tie_embeddings=False))  # tied weights cannot span stages


def _batches(batch):
    gen = torch.Generator().manual_seed(SEED + 2)
    ids = torch.randint(0, CONFIG["vocab_size"], (STEPS, batch, SEQ + 1), generator=gen)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _autocast(bf16):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def _reference(batches, bf16):
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids, targets in batches:
        opt.zero_grad()
        with _autocast(bf16):
            loss = model(ids, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _rank_3d(dp, tp, pp, cases):
    mesh = dk.ProcessMesh(dp=dp, pp=pp, tp=tp)
    batches = _batches(dp * PER_REPLICA)
    out = []
    for bf16, sp in cases:
        reference, ref_losses = _reference(batches, bf16)
        model = _gpt().parallelize(mesh.tp_comm, sequence_parallel=sp)
        pipe = dk.Pipeline(
            model.as_sequential(),
            mesh,
            n_microbatches=MICROBATCHES,
            schedule="1f1b",
            loss_fn=model.loss,
            print_partition=False,
        )
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        mine = slice(mesh.dp_rank * PER_REPLICA, (mesh.dp_rank + 1) * PER_REPLICA)
        losses = []
        for ids, targets in batches:
            opt.zero_grad()
            with _autocast(bf16):
                losses.append(pipe.step(ids[mine], targets[mine]).item())
            opt.step()
        ref_stages = reference.as_sequential()
        diffs = []
        for module in pipe.stages.values():
            ref_module = _stage_of(ref_stages, module)
            diffs.append(max_param_diff(module, ref_module, mesh.tp_rank))
        moved = max_param_diff(_gpt(), reference, 0)  # how far training moved the weights
        if dp > 1:  # the size of a lost dp reduction: this replica's data alone
            alone, _ = _reference([(i[mine], t[mine]) for i, t in batches], bf16)
            moved = min(moved, max_param_diff(alone, reference, 0))
        out.append((bf16, sp, repr(mesh), max(diffs), moved, losses, ref_losses))
    mesh.close()
    return out


def _stage_of(ref_sequential, stage_module):
    """The reference children matching the pipeline stage ``stage_module`` (same names)."""
    names = [n for n, _ in stage_module.named_children()]
    return torch.nn.Sequential(OrderedDict((n, ref_sequential[int(n)]) for n in names))


CASES = [(False, False), (False, True), (True, True)]  # (bf16 autocast, sequence parallel)


def _check(results, dp):
    for rank, per_case in enumerate(results):
        for bf16, sp, mesh, diff, moved, _, _ in per_case:
            print(
                f"rank {rank} {mesh} bf16={bf16} sp={sp}: max parameter difference "
                f"{diff:.1e} (a wrong answer: {moved:.1e})"
            )
            # FP32: rounding only. BF16: autocast rounds each matmul differently once split
            # over tp (partial sums) and micro-batches. `moved` is the smaller of how far
            # training moved the weights and (dp > 1) how far one replica's data alone moves
            # them from the reference: what a lost dp reduction would look like.
            assert diff < (0.1 if bf16 else 1e-4) * moved, (rank, bf16, sp, diff, moved)
    # Every rank of a pipeline returns its replica's loss; the replicas' mean is the batch's.
    ranks_per_replica = len(results) // dp
    for i, (bf16, _) in enumerate(CASES):
        ref_losses = results[0][i][6]
        for step, ref in enumerate(ref_losses):
            replicas = [results[d * ranks_per_replica][i][5][step] for d in range(dp)]
            mean = sum(replicas) / dp
            print(f"bf16={bf16} step {step}: loss {mean:.6f}, single process {ref:.6f}")
            assert mean == pytest.approx(ref, abs=2e-2 if bf16 else 1e-5)


def test_1x2x2_on_4_ranks_equals_single_process():
    print("seed", SEED)
    results = run_ranks(4, _rank_3d, 1, 2, 2, CASES, timeout=300)
    _check(results, 1)


def test_2x2x2_on_8_ranks_equals_single_process():
    print("seed", SEED)
    results = run_ranks(8, _rank_3d, 2, 2, 2, CASES, timeout=600)
    _check(results, 2)
