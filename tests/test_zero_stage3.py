"""ZeRO stage 3 (parameters sharded, gathered per unit of modules) against single-process runs.

Every rank trains its slice of a global batch at stage 3 and, in the same process, a plain copy
of the model on the whole batch (FP32: the unsharded optimizer; BF16: the same mixed-precision
recipe, 16-bit parameters and gradients stepping FP32 masters). Between iterations a rank holds
only its shard: the model's full parameters have no storage (checked).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mp_pool import run_ranks  # noqa: E402
from test_zero import (  # noqa: E402
    ALIGN_BYTES,
    SEED,
    batch,
    make_comm,
    make_model,
    max_rel_diff,
    optimizer_spec,
)

STEPS = 4


class Checkpointed(torch.nn.Module):
    """``make_model()`` with every layer under activation checkpointing (non-reentrant)."""

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.seq = make_model(dtype=dtype)

    def forward(self, x):
        for layer in self.seq:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def _build(options):
    dtype = options.get("dtype", torch.float32)
    return Checkpointed(dtype) if options.get("checkpoint") else make_model(dtype=dtype)


def _loss(model, step, world_size, rank, dtype):
    x, y = batch(step, world_size, rank)
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def reference(opt_name, world_size, options):
    """Single process, whole batch; 16-bit models step FP32 masters (mixed precision)."""
    dtype = options.get("dtype", torch.float32)
    model = _build(options)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    cls, kwargs = optimizer_spec(opt_name)
    opt = cls(masters, **kwargs)
    for step in range(STEPS):
        _reference_grads(model, masters, step, world_size, dtype)
        if options.get("clip"):
            torch.nn.utils.clip_grad_norm_(masters, options["clip"])
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return model


def _reference_grads(model, masters, step, world_size, dtype):
    """FP32 gradients of the whole batch into ``masters``. For 16-bit models as data
    parallelism makes them: each rank's slice backward in 16 bits, the slices averaged in
    FP32 and rounded to 16 bits once (the reduce-scatter's arithmetic)."""
    params = list(model.parameters())
    slices = range(world_size) if dtype != torch.float32 else [None]
    total = [torch.zeros_like(m) for m in masters]
    for rank in slices:
        _loss(model, step, world_size, rank, dtype).backward()
        for t, p in zip(total, params):
            t += p.grad.float()
            p.grad = None
    for m, t in zip(masters, total):
        m.grad = (t / len(slices)).to(dtype).float()


def _units(gatherer):
    """Per unit, in module order (root first): (bytes the engine gathers for it, bytes of its
    parameters, number of its parameters)."""
    rows = []
    for unit in gatherer.units:
        own = [p for p in unit.module.parameters() if gatherer.unit_of_param(p) == unit.index]
        raw = sum(p.numel() * p.element_size() for p in own)
        rows.append((unit.nbytes, raw, len(own)))
    return rows


def expected_peak(units, world_size):
    """Bytes gathered at the worst moment of forward and backward, from the schedule: the root
    (always), the running unit and the one prefetched after it (stage3.py's module docstring),
    in module order (forward) and reverse (backward): root + the largest sum of two consecutive
    units. Each unit's size is its parameters plus the plan's alignment padding: 16 bytes per
    parameter offset and per rank's slice at most."""
    for nbytes, raw, n_params in units:
        assert raw <= nbytes <= raw + ALIGN_BYTES * (n_params + world_size), units
    sizes = [nbytes for nbytes, _, _ in units[1:]]
    return units[0][0] + max(a + b for a, b in zip(sizes, sizes[1:]))


def _stage3_cases(cases):
    import dist_kernels as dk

    comm = make_comm()
    results = []
    for opt_name, options in cases:
        dtype = options.get("dtype", torch.float32)
        model = _build(options)
        cls, kwargs = optimizer_spec(opt_name)
        opt = dk.ShardedOptimizer(
            model.parameters(), cls, comm, stage=3, module=model, bucket_cap_mb=0.0002, **kwargs
        )
        freed, grads_kept = True, False
        for step in range(STEPS):
            _loss(model, step, comm.world_size, comm.rank, dtype).backward()
            grads_kept |= any(p.grad is not None for p in model.parameters())
            if options.get("clip"):
                opt.clip_grad_norm_(options["clip"])
            opt.step()
            opt.zero_grad()
            freed &= all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        report = opt.memory_report()
        peak = opt._gatherer.peak_gathered_bytes  # of training (full_parameters gathers all)
        ref = reference(opt_name, comm.world_size, options)
        with opt.full_parameters():
            diff = max_rel_diff(model, ref)
        results.append(
            {
                "diff": diff,
                "freed": freed,
                "grads_kept": grads_kept,
                "within": report.within_formula(),
                "report": str(report),
                "peak_gathered": peak,
                "units": _units(opt._gatherer),
            }
        )
        opt.close()
    comm.close()
    return results


# Adam divides by the gradient's own RMS and clipping rescales to a norm: both are blind to a
# constant gradient factor (a sum for an average, a gradient counted twice). Each kind of run
# (FP32, BF16, checkpointed) therefore also trains with plain SGD, whose update is proportional
# to the gradient.
CASES = [
    ("adamw", {}),
    ("sgd", {}),
    ("fused", {}),
    ("adamw", {"dtype": torch.bfloat16}),
    ("fused", {"dtype": torch.bfloat16}),
    ("sgd", {"dtype": torch.bfloat16}),
    ("sgd", {"dtype": torch.bfloat16, "clip": 0.05}),
    ("fused", {"clip": 0.05}),
    ("adamw", {"checkpoint": True}),
    ("sgd", {"checkpoint": True}),
    ("fused", {"checkpoint": True, "dtype": torch.bfloat16}),
    ("sgd", {"checkpoint": True, "dtype": torch.bfloat16}),
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stage3_equals_single_process_training(world_size):
    """FP32: the reference runs the whole batch in one backward, the ranks their slices: the
    sums differ by FP32 rounding (measured at most 2.3e-7 relative; 1e-5 allowed).

    BF16: bitwise. The reference repeats the mixed-precision arithmetic: the same per-slice
    16-bit backwards (bitwise the same on one machine), an FP32 sum of the slices rounded to
    BF16 once, the same FP32 optimizer on the masters. Two ranks add in the same order
    (a + b = b + a exactly); from three on the ring adds in another order, which changes the
    FP32 sum by an ulp at most and its BF16 rounding only at a rounding boundary, with
    probability about (n - 1) 2^-16 per element: ~0.2 expected over this run's 1,000 elements
    x 4 steps, and none here (the seeded run repeats bitwise). One flip would move a BF16
    parameter by an ulp (2^-8 relative), far above any rounding slack a tolerance could give.
    """
    per_rank = run_ranks(world_size, _stage3_cases, CASES, timeout=240)
    print(f"seed {SEED}, {STEPS} steps, world size {world_size}")
    for i, (opt_name, options) in enumerate(CASES):
        rows = [r[i] for r in per_rank]
        diff = max(r["diff"] for r in rows)
        peak = max(r["peak_gathered"] for r in rows)
        print(f"stage 3 {opt_name:6s} {options}: max rel diff {diff:.2e}, gathered peak {peak} B")
    for i, (_, options) in enumerate(CASES):
        rows = [r[i] for r in per_rank]
        diff = max(r["diff"] for r in rows)
        if options.get("dtype", torch.float32) == torch.float32:
            assert diff < 1e-5, f"case {CASES[i]}: max relative difference {diff:.3e}"
        else:
            assert diff == 0.0, f"case {CASES[i]}: max relative difference {diff:.3e}"
        assert all(r["freed"] for r in rows), "full parameters kept between iterations"
        assert not any(r["grads_kept"] for r in rows), ".grad kept after backward"
        assert all(r["within"] for r in rows), rows[0]["report"]
        for r in rows:
            assert r["peak_gathered"] == expected_peak(r["units"], world_size), (CASES[i], r)


def test_stage3_reference_rejects_a_wrong_answer():
    """The comparison is not vacuous: one skipped step is far outside the tolerance."""
    good = reference("adamw", 1, {})
    global STEPS
    saved, STEPS = STEPS, STEPS - 1
    try:
        short = reference("adamw", 1, {})
    finally:
        STEPS = saved
    assert max_rel_diff(short, good) > 1e-3


# -- tied parameters: a head sharing the embedding's weight (stage3.py: _owners) -------------


def _tied_gpt(seed):
    from dist_kernels.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layers=2, n_heads=2, dim=32))


def _gpt_batch(step, world_size, rank):
    """This rank's slice of the step's global batch (2 sequences per rank)."""
    gen = torch.Generator().manual_seed(SEED + step)
    ids = torch.randint(0, 64, (2 * world_size, 17), generator=gen)
    mine = ids[2 * rank : 2 * rank + 2]
    return mine[:, :-1], mine[:, 1:]


def _tied_stage3(steps):
    """The tied GPT at stage 3 with its default units against the same training in one
    process on the whole batch; also which unit gathers the tied weight."""
    import dist_kernels as dk

    comm = make_comm()
    model, ref = _tied_gpt(SEED), _tied_gpt(SEED)
    assert model.head.lm_head.weight is model.embedding.wte.weight, "the GPT is not tied"
    opt = dk.ShardedOptimizer(
        model.parameters(), torch.optim.SGD, comm, stage=3, module=model, lr=0.5
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    owner = opt._gatherer.units[opt._gatherer.unit_of_param(model.embedding.wte.weight)].name
    for step in range(steps):
        ids, targets = _gpt_batch(step, comm.world_size, comm.rank)
        model(ids, targets).backward()
        opt.step()
        opt.zero_grad()
        losses = []
        for r in range(comm.world_size):  # the whole batch: the mean of the ranks' mean losses
            losses.append(ref(*_gpt_batch(step, comm.world_size, r)))
        (sum(losses) / comm.world_size).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with opt.full_parameters():
        diff = max_rel_diff(model, ref)
    opt.close()
    comm.close()
    return owner, diff


def test_stage3_tied_embedding_and_head_gathered_together():
    """The head's weight is the embedding's: both modules are default units, so gathered by
    either alone the weight is freed while the other reads it. It belongs to the root, and
    training equals one process on the whole batch (FP32 sums: 1e-5 relative). SGD, because
    the tied weight's four gradient terms (head and embedding, two slices) are added in
    another order than in the single process: rounding-level apart, which SGD keeps at that
    level and AdamW magnifies where a gradient is near zero (1e-3 after two steps)."""
    results = run_ranks(2, _tied_stage3, 3, timeout=240)
    print(f"seed {SEED}: {results}")
    for owner, diff in results:
        assert owner == "<root>", f"the tied weight is gathered with {owner!r}"
        assert diff < 1e-5, f"max relative difference {diff:.3e}"
