"""The GPT with its sequence sharded over cp trains like one process on the whole sequence: at
cp = 2 (2 ranks), and at dp x cp x tp = 2 x 2 x 2 (8 ranks, tensor-parallel with and without
sequence parallelism), five AdamW steps in float64, every gradient averaged over dp x cp on
``mesh.dp_cp_comm`` (our DDP buckets have no float64; tests/test_train.py runs it at cp = 2)."""

import pytest
import torch
from mp_pool import run_ranks
from test_gpt_tp import CONFIG, LLAMA, SEED, max_param_diff

import dist_kernels as dk
from dist_kernels import context_parallel as cp
from dist_kernels.models import GPT, GPTConfig

STEPS = 5
SEQ = 16  # divisible by 2 x cp: zig-zag chunks of 4 at cp = 2
PER_REPLICA = 2


def _model(**overrides):
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**{**CONFIG, "block_size": SEQ, **overrides})).double()


def _batches(batch):
    gen = torch.Generator().manual_seed(SEED + 3)
    ids = torch.randint(0, CONFIG["vocab_size"], (STEPS, batch, SEQ + 1), generator=gen)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _train(model, batches, step_fn, grad_comm=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for ids, targets in batches:
        opt.zero_grad()
        loss = step_fn(ids, targets)
        loss.backward()
        for p in model.parameters() if grad_comm is not None else ():
            grad_comm.all_reduce(p.grad, op="avg")
        opt.step()
        losses.append(loss.item())
    return losses


def _rank_gpt_cp(dp, tp, cp_size, sequence_parallel_cases, lose_cp_reduction=False, overrides=None):
    mesh = dk.ProcessMesh(dp=dp, pp=1, tp=tp, cp=cp_size)
    batches = _batches(dp * PER_REPLICA)
    options = overrides or {}
    reference = _model(**options)
    ref_losses = _train(reference, batches, reference)
    mine = slice(mesh.dp_rank * PER_REPLICA, (mesh.dp_rank + 1) * PER_REPLICA)
    out = []
    for sp in sequence_parallel_cases:
        model = _model(**options)
        if tp > 1:
            model.parallelize(mesh.tp_comm, sequence_parallel=sp)
        model.context_parallel(mesh.cp_comm)
        # the bug the test must catch: gradients averaged over dp only, not over dp x cp
        comm = mesh.dp_comm if lose_cp_reduction else mesh.dp_cp_comm

        def step(ids, targets, model=model):
            ids, targets = (cp.shard_sequence(t[mine], mesh.cp_comm, dim=1) for t in (ids, targets))
            return model(ids, targets)

        losses = _train(model, batches, step, comm)
        diff = max_param_diff(model, reference, mesh.tp_rank)
        moved = max_param_diff(_model(**options), reference, 0)
        out.append((sp, diff, moved, losses, ref_losses))
    mesh.close()
    return out


def _check(results, dp, lost=False):
    for rank, per_case in enumerate(results):
        for sp, diff, moved, losses, ref_losses in per_case:
            print(f"rank {rank} sp={sp}: max parameter difference {diff:.1e} (moved {moved:.1e})")
            if lost:
                assert diff > 1e-4 * moved, (rank, diff, moved)
                continue
            # float64 throughout: only the order of sums differs (ring merge, all-reduces)
            assert diff < 1e-12, (rank, sp, diff)
            if dp == 1:  # every rank's loss is the mean over the whole sequences
                assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-12
    if dp > 1:  # the replicas' mean is the batch's (replicas: dp_rank = rank // (tp x cp))
        per_replica = len(results) // dp
        for i in range(len(results[0])):
            for step, ref in enumerate(results[0][i][4]):
                mean = sum(results[d * per_replica][i][3][step] for d in range(dp)) / dp
                assert abs(mean - ref) < 1e-12, (step, mean, ref)


def test_gpt_at_cp2_trains_like_one_process():
    print("seed", SEED)
    _check(run_ranks(2, _rank_gpt_cp, 1, 1, 2, [False], timeout=300), dp=1)


# YaRN stretched 4x from a trained length of 8: every pair's frequency and the attention
# factor differ from plain rope's
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
# LongRoPE trained on 12 positions: the 16-long sequence takes the long factors, which a rank
# that judged by its own shard (positions 4-11 on rank 1 at cp = 2) would not
LONGROPE = {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 12,
            "short_factor": [1.0, 1.5], "long_factor": [3.0, 17.0]}  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"rope_scaling": YARN},
        {"rotary_percent": 0.5, "kv_channels": 4},
        {"rope_scaling": LONGROPE, "kv_channels": 4},
    ],
    ids=["rope", "rope-yarn", "rope-partial", "rope-longrope"],
)
def test_llama_style_gpt_at_cp2_trains_like_one_process(extra):
    """Rotary embeddings on zig-zag shards: each rank turns its queries and keys by their
    global positions (a rank's shard holds positions 0-3 and 12-15 at cp = 2), scaled or not,
    over every dimension of a head or its first half (Phi's partial rotary)."""
    print("seed", SEED)
    options = {**LLAMA, **extra}
    _check(run_ranks(2, _rank_gpt_cp, 1, 1, 2, [False], False, options, timeout=300), dp=1)


def test_gpt_at_cp2_without_the_cp_reduction_differs():
    _check(run_ranks(2, _rank_gpt_cp, 1, 1, 2, [False], True, timeout=300), dp=1, lost=True)


def test_gpt_at_dp2_cp2_tp2_on_8_ranks_trains_like_one_process():
    print("seed", SEED)
    _check(run_ranks(8, _rank_gpt_cp, 2, 2, 2, [False, True], timeout=600), dp=2)
