"""Context parallelism: the layout on paper against a brute-force causal mask; ring attention
at cp = 1..4 against F.scaled_dot_product_attention on the whole sequence (output and the
gradients of q, k, v) in float64, float32 and bf16; shard / gather / positions / the loss over
a sharded sequence; errors raised on every rank."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from mp_pool import run_ranks

from dist_kernels.context_parallel import layout

SEED = 20261202
CP_SIZES = (1, 2, 3, 4)

# ------------------------------------------------------------------ the layout, on paper


@pytest.mark.parametrize("load_balance", (False, True))
def test_positions_partition_the_sequence(load_balance):
    for cp in range(1, 17):
        seq = 2 * cp * 3
        held = [layout.positions(seq, r, cp, load_balance) for r in range(cp)]
        assert sorted(p for h in held for p in h) == list(range(seq))
        for r, h in enumerate(held):
            assert h == sorted(h)  # local order is global order
            chunk = seq // (2 * cp)
            if load_balance:  # chunks r and 2cp-1-r
                assert h == [*range(r * chunk, (r + 1) * chunk)] + [
                    *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)
                ]
            else:
                assert h == list(range(r * seq // cp, (r + 1) * seq // cp))


def _covered(blocks, local):
    """{(i, j): count} of local (query, key) pairs the blocks compute."""
    seen = {}
    for b in blocks:
        for i in range(b.q.start, b.q.stop):
            for j in range(b.kv.start, b.kv.stop):
                if not b.causal or (i - b.q.start) >= (j - b.kv.start):
                    seen[(i, j)] = seen.get((i, j), 0) + 1
    return seen


@pytest.mark.parametrize("causal, load_balance", list(itertools.product((False, True), repeat=2)))
def test_blocks_cover_exactly_the_mask(causal, load_balance):
    """Every (query, key) pair the global mask allows is computed once, no other pair; the
    backward's split of the own block covers it the same way."""
    for cp in range(1, 9):
        seq = 2 * cp * 3 if load_balance else cp * 5
        local = seq // cp
        pos = [layout.positions(seq, r, cp, load_balance) for r in range(cp)]
        work = []
        for r, j in itertools.product(range(cp), repeat=2):
            blk = layout.block(r, j, local, causal, load_balance)
            want = {
                (a, b): 1
                for a in range(local)
                for b in range(local)
                if not causal or pos[r][a] >= pos[j][b]
            }
            assert _covered([blk] if blk else [], local) == want, (cp, r, j)
            if r == j:
                early, late = layout.own_block_split(local, causal)
                assert _covered(early + late, local) == want
            work.append((r, len(want)))
        per_rank = [sum(n for rank, n in work if rank == r) for r in range(cp)]
        if load_balance or not causal:
            assert len(set(per_rank)) == 1, per_rank  # every rank does the same work
    with pytest.raises(ValueError, match=r"not divisible by 2 x cp\(3\) = 6 .* 20 % 6 = 2"):
        layout.positions(20, 0, 3, True)


def test_head_groups_partition_the_heads():
    """Every (sample, head) in exactly one group, the groups within one head of each other and
    as many as the cap allows (each pass of the ring holds one group's buffers)."""
    assert layout.MAX_HEAD_GROUPS == 8
    for batch, heads in itertools.product((1, 2, 3, 8, 9), (1, 3, 8, 12)):
        groups = layout.head_groups(batch, heads)
        pairs = [(b, h) for b, hs in groups for h in range(hs.start, hs.stop)]
        assert sorted(pairs) == list(itertools.product(range(batch), range(heads)))
        sizes = {hs.stop - hs.start for _, hs in groups}
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, (batch, heads, groups)
    # with the cap at 8: one head a pass for the benchmark's 1 x 8; 2 x 3 (these tests) one
    # head a pass; 3 samples get 2 groups each; past 8 samples one group a sample
    for (batch, heads), count in {(1, 8): 8, (2, 3): 6, (3, 8): 6, (9, 3): 9, (1, 12): 8}.items():
        assert len(layout.head_groups(batch, heads)) == count, (batch, heads)


# ------------------------------------------------------------------ ring attention


def _bounds(q, k, v, g, dtype, causal, scale):
    """Per-element error bounds on the output and the q, k, v gradients, from float64
    magnitudes of the whole-sequence attention.

    Each result is a sum of terms computed with FP32 accumulation (FP64 for float64) from
    inputs exact in ``dtype``; ring attention rounds each block's result to ``dtype`` once
    before the blocks merge in FP32, and the merged sum once more. So a result's error is at
    most ``eps_acc (n + d) (1 + 2 s) + rounds x eps_dtype`` times the sum of the magnitudes of
    its terms: ``n + d`` roundings along the key sums and the dot products, ``2 s`` the
    softmax's sensitivity to score errors (``s`` the largest ``|scale q| . |k|``), ``rounds``
    roundings to ``dtype`` (out: each block's and the final one; gradients: the same and the
    rounded output the backward reads).
    """
    q, k, v, g = (t.double() for t in (q, k, v, g))
    n, d = k.shape[-2], k.shape[-1]
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(scores, -1)
    s = (scale * (q.abs() @ k.abs().transpose(-1, -2))).max().item()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    per = torch.finfo(acc).eps * (n + d) * (1 + 2 * s)
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    delta = (g * (p @ v)).sum(-1, keepdim=True)
    ds = p * ((g @ v.transpose(-1, -2)).abs() + delta.abs())  # |dS| magnitudes, FlashAttention's
    return {
        "out": (per + 2 * eps) * (p @ v.abs()) + tiny,
        "q": (per + 3 * eps) * scale * (ds @ k.abs()) + tiny,
        "k": (per + 3 * eps) * scale * (ds.transpose(-1, -2) @ q.abs()) + tiny,
        "v": (per + 3 * eps) * (p.transpose(-1, -2) @ g.abs()) + tiny,
    }


def _whole(q, k, v, g, causal, dtype):
    """F.scaled_dot_product_attention on the whole sequence in ``dtype``: output, gradients."""
    q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(g.to(dtype))
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _shard(x, rank, cp, load_balance, dim=2):
    index = torch.tensor(layout.positions(x.shape[dim], rank, cp, load_balance))
    return x.index_select(dim, index)


def _heads(qkv):
    """q, k, v ``[b, h, s, d]``: strided views of ``[s, b, h, 3, d]``, as the GPT makes them."""
    return qkv.permute(3, 1, 2, 0, 4).unbind(0)


def _rank_ring(cases):
    import dist_kernels as dk
    from dist_kernels.context_parallel import ring_attention

    comm = dk.Communicator()
    rank, cp = comm.rank, comm.world_size
    report = []
    for case in cases:
        if len(case) == 5:  # grouped key / value heads
            report += _ring_grouped(comm, *case)
            continue
        causal, load_balance, dtype, seed = case
        seq = 2 * cp * 5 if load_balance else cp * 7  # odd chunks: 5 each, or 7 a rank
        gen = torch.Generator().manual_seed(seed)
        qkv = torch.randn(seq, 2, 3, 3, 8, generator=gen).to(dtype)  # exact in dtype
        g = torch.randn(2, 3, seq, 8, generator=gen).to(dtype)
        truth = _whole(*_heads(qkv), g, causal, torch.float64)
        torch_in_dtype = _whole(*_heads(qkv), g, causal, dtype)
        bounds = _bounds(*_heads(qkv), g, dtype, causal, 1 / math.sqrt(8))
        mine = _shard(qkv, rank, cp, load_balance, dim=0).requires_grad_()
        out = ring_attention(*_heads(mine), comm, causal=causal, load_balance=load_balance)
        out.backward(_shard(g, rank, cp, load_balance))
        ours = dict(zip("qkv", _heads(mine.grad)), out=out.detach())
        for name, value in ours.items():
            assert value.dtype == dtype, (name, value.dtype)
            want, bound, theirs = (
                _shard(t[name], rank, cp, load_balance) for t in (truth, bounds, torch_in_dtype)
            )
            error = (value.double() - want).abs()
            if dtype == torch.float64:  # the absolute bar, beside the derived bound
                assert error.max() <= 1e-12, (causal, load_balance, name, error.max().item())
            ratio = (error / bound).max().item()
            torch_ratio = ((theirs.double() - want).abs() / bound).max().item()
            report.append((causal, load_balance, str(dtype), name, ratio, torch_ratio))
    comm.close()
    return report


def _ring_grouped(comm, causal, load_balance, dtype, seed, groups):
    """Grouped-query attention, ``groups`` key / value heads for 4 query heads, float64:
    ring attention moving the grouped heads against SDPA on the whole sequence with each key
    / value head repeated for its query heads (their gradients summed back by autograd)."""
    from dist_kernels.context_parallel import ring_attention

    rank, cp = comm.rank, comm.world_size
    seq, r = 2 * cp * 5 if load_balance else cp * 7, 4 // groups
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, seq, 8, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, groups, seq, 8, generator=gen, dtype=dtype) for _ in range(2))
    g = torch.randn(2, 4, seq, 8, generator=gen, dtype=dtype)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expanded = [t.repeat_interleave(r, dim=1) for t in whole[1:]]
    out = F.scaled_dot_product_attention(whole[0], *expanded, is_causal=causal)
    out.backward(g)
    truth = dict(zip("qkv", (t.grad for t in whole)), out=out.detach())
    mine = [_shard(t, rank, cp, load_balance).requires_grad_() for t in (q, k, v)]
    ours = ring_attention(*mine, comm, causal=causal, load_balance=load_balance)
    ours.backward(_shard(g, rank, cp, load_balance))
    got = dict(zip("qkv", (t.grad for t in mine)), out=ours.detach())
    report = []
    for name, value in got.items():
        error = (value - _shard(truth[name], rank, cp, load_balance)).abs().max().item()
        assert error <= 1e-12, (causal, load_balance, groups, name, error)
        report.append((causal, load_balance, f"{dtype} {groups} kv heads", name, 0.0, 0.0))
    return report


@pytest.mark.parametrize("cp", CP_SIZES)
def test_ring_attention_equals_sdpa_on_the_whole_sequence(cp):
    print("seed", SEED)
    cases = [
        (causal, lb, dtype, SEED + i)
        for i, (causal, lb, dtype) in enumerate(
            itertools.product(
                (False, True), (False, True), (torch.float64, torch.float32, torch.bfloat16)
            )
        )
    ]
    # grouped-query attention: 2 key / value heads (r = 2) and 1 (multi-query), float64
    cases += [
        (True, True, torch.float64, SEED + 20, 2),
        (False, False, torch.float64, SEED + 21, 1),
    ]
    results = run_ranks(cp, _rank_ring, cases, timeout=300)
    worst = {}
    for report in results:
        for causal, lb, dtype, name, ratio, torch_ratio in report:
            key = (causal, lb, dtype, name)
            worst[key] = max(worst.get(key, (0, 0)), (ratio, torch_ratio))
    for key, (ratio, torch_ratio) in sorted(worst.items()):
        print(key, f"error / bound: ours {ratio:.3f}, torch in that dtype {torch_ratio:.3f}")
    bad = {k: r for k, (r, _) in worst.items() if r > 1}
    assert not bad, bad


def test_ring_attention_across_hosts():
    """A cp group over two (emulated) hosts: the ring crosses between them on the hierarchical
    communicator's gloo links (the mesh warns about such a group; it still computes right)."""
    cases = [(True, True, torch.float64, SEED), (False, True, torch.float32, SEED + 1)]
    env = {"DK_HOST_ID": ["host-a", "host-a", "host-b", "host-b"]}
    for report in run_ranks(4, _rank_ring, cases, env=env, timeout=300):
        assert all(ratio <= 1 for *_, ratio, _ in report), report


def test_the_bound_rejects_a_missing_block():
    """The float32 bound is tight enough to fail attention that lost one ring step's keys."""
    gen = torch.Generator().manual_seed(SEED)
    qkv = torch.randn(20, 2, 3, 3, 8, generator=gen)
    g = torch.randn(2, 3, 20, 8, generator=gen)
    q, k, v = _heads(qkv)
    truth = _whole(q, k, v, g, True, torch.float64)["out"]
    bound = _bounds(q, k, v, g, torch.float32, True, 1 / math.sqrt(8))["out"]
    assert ((_whole(q, k, v, g, True, torch.float32)["out"] - truth).abs() <= bound).all()
    keep = list(range(10, 20))  # the second half's queries without the first half's keys
    lost = F.scaled_dot_product_attention(
        q[:, :, keep], k[:, :, keep], v[:, :, keep], is_causal=True
    )
    assert ((lost.double() - truth[:, :, keep]).abs() > bound[:, :, keep]).any()


# ------------------------------------------------------------------ shard, gather, positions, loss


def _rank_shard_gather(load_balance):
    import dist_kernels as dk
    from dist_kernels import context_parallel as cp

    comm = dk.Communicator()
    rank, size = comm.rank, comm.world_size
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, 4 * size, 3, dtype=torch.float64, generator=gen).requires_grad_()
    grads = [torch.randn(2, 2 * 2, 3, dtype=torch.float64, generator=gen) for _ in range(size)]
    mine = cp.positions(4 * size, comm, load_balance)
    shard = cp.shard_sequence(x, comm, dim=1, load_balance=load_balance)
    assert torch.equal(shard, x.detach().index_select(1, mine))
    shard.backward(grads[rank])  # adjoint: every rank's gradient, each in its own positions
    want = torch.zeros_like(x)
    for r in range(size):
        want[:, cp.positions(4 * size, _Fake(r, size), load_balance)] = grads[r]
    assert torch.equal(x.grad, want)
    leaf = shard.detach().requires_grad_()
    whole = cp.gather_sequence(leaf, comm, dim=-2, load_balance=load_balance)
    assert torch.equal(whole, x.detach())
    upstream = [torch.randn(x.shape, dtype=torch.float64, generator=gen) for _ in range(size)]
    whole.backward(upstream[rank])  # adjoint: the sum over ranks of this rank's positions
    assert torch.allclose(leaf.grad, sum(upstream).index_select(1, mine), rtol=0, atol=1e-15)
    comm.close()
    return mine.tolist()


class _Fake:
    """Rank and size of a context-parallel group, for the pure position functions."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


@pytest.mark.parametrize("load_balance", (False, True))
def test_shard_and_gather_are_inverse_with_adjoint_gradients(load_balance):
    print("seed", SEED)
    held = run_ranks(3, _rank_shard_gather, load_balance)
    assert sorted(p for h in held for p in h) == list(range(12))


def _rope(x, pos):
    """Rotary embedding of ``x`` [b, s, d] at positions ``pos`` (pairs of features rotate)."""
    half = x.shape[-1] // 2
    angle = pos[:, None].double() / 10000 ** (torch.arange(half).double() / half)
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


@pytest.mark.parametrize("load_balance", (False, True))
def test_positions_give_rotary_and_learned_positions_of_the_whole_sequence(load_balance):
    from dist_kernels import context_parallel as cp

    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, 24, 8, dtype=torch.float64, generator=gen)
    table = torch.randn(24, 8, dtype=torch.float64, generator=gen)
    whole_rope, whole_learned = _rope(x, torch.arange(24)), x + table
    for size in (1, 2, 3):
        for r in range(size):
            pos = cp.positions(24, _Fake(r, size), load_balance)
            mine = x.index_select(1, pos)
            assert torch.equal(_rope(mine, pos), whole_rope.index_select(1, pos))
            assert torch.equal(mine + table[pos], whole_learned.index_select(1, pos))


def _rank_sequence_mean():
    import dist_kernels as dk
    from dist_kernels import context_parallel as cp

    comm = dk.Communicator()
    rank, size = comm.rank, comm.world_size
    gen = torch.Generator().manual_seed(SEED)
    logits = torch.randn(size, 6, 5, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, 5, (size, 6), generator=gen)
    targets[0, :4] = -100  # rank 0 counts 2 tokens, the others 6: unequal shards
    mine = logits[rank].clone().requires_grad_()
    local = F.cross_entropy(mine, targets[rank], reduction="sum")
    loss = cp.sequence_mean(local, (targets[rank] != -100).sum(), comm)
    loss.backward()
    whole = logits.clone().requires_grad_()
    ref = F.cross_entropy(whole.flatten(0, 1), targets.flatten())  # mean over counted tokens
    ref.backward()
    comm.close()
    # the backward is that of the sum of every rank's (replicated) loss: size x the share
    return loss.item(), ref.item(), (mine.grad - size * whole.grad[rank]).abs().max().item()


def test_sequence_mean_is_the_mean_over_every_token():
    print("seed", SEED)
    for loss, ref, grad_error in run_ranks(2, _rank_sequence_mean):
        assert abs(loss - ref) <= 1e-15 and grad_error <= 1e-16


# ------------------------------------------------------------------ errors, on every rank


def _rank_errors():
    import dist_kernels as dk
    from dist_kernels import context_parallel as cp

    comm = dk.Communicator()
    rank = comm.rank
    messages = []
    for what, call in (
        ("shard", lambda: cp.shard_sequence(torch.zeros(1, 10), comm, dim=1)),
        ("lengths", lambda: cp.ring_attention(*[torch.zeros(1, 2, 4 + 2 * rank, 8)] * 3, comm)),
        (
            "odd",
            lambda: cp.ring_attention(*[torch.zeros(1, 2, 3, 8)] * 3, comm, causal=True),
        ),
        (
            "shape",
            lambda: cp.ring_attention(
                torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 8), comm
            ),
        ),
    ):
        with pytest.raises(ValueError) as info:
            call()
        messages.append((what, str(info.value)))
    out = cp.ring_attention(*[torch.ones(1, 2, 4, 8)] * 3, comm, causal=True)  # still usable
    comm.close()
    return messages, out.sum().item()


def test_bad_input_raises_on_every_rank_with_the_arithmetic():
    for rank, (messages, total) in enumerate(run_ranks(2, _rank_errors)):
        text = dict(messages)
        print(rank, text)
        assert text["shard"] == (
            f"[rank {rank}] shard_sequence: sequence length 10 is not divisible by 2 x cp(2) "
            "= 4 (load balancing cuts it into 2 cp chunks): 10 % 4 = 2"
        )
        assert (
            "shard lengths differ between ranks: seq / cp = [4, 6] on cp ranks 0..1"
            in text["lengths"]
        )
        assert "seq / cp = 3 is odd (seq = 6 is not divisible by 2 x cp(2) = 4)" in text["odd"]
        assert "q, k, v shapes differ: (1, 2, 4, 8), (1, 2, 4, 4)" in text["shape"]
        assert total == 64.0  # softmax-weighted ones: ones
