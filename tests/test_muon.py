"""dk.optim.Muon: torch.optim.Muon + torch.optim.AdamW bit for bit on one process, and the
same training on dp x tp ranks (Newton-Schulz dealt over dp, tp shards joined) as one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from mp_pool import run_ranks
from test_gpt_tp import shard_of

import dist_kernels as dk
from dist_kernels.models import GPT, GPTConfig
from dist_kernels.optim import Muon, deal_matrices, muon_param_groups

SEED = 4321
STEPS = 4
GPT_CFG = dict(n_layers=2, n_heads=4, dim=16, block_size=8, vocab_size=32, tie_embeddings=False)


def _mlp() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Embedding(40, 16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16), nn.LayerNorm(16)
    )


def _mlp_steps(model, optimizers, steps=STEPS, start=0):
    for step in range(start, start + steps):
        ids = torch.randint(0, 40, (4, 7), generator=torch.Generator().manual_seed(SEED + step))
        model(ids).pow(2).mean().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_one_process_equals_torch_muon_and_adamw_bitwise(nesterov, adjust_lr_fn):
    """Muon groups step as torch.optim.Muon, AdamW groups as torch.optim.AdamW: same bits."""
    print("seed", SEED)
    ours_model, torch_model = _mlp(), _mlp()
    ours = Muon(
        muon_param_groups(ours_model, weight_decay=0.1),
        lr=0.02,
        nesterov=nesterov,
        adjust_lr_fn=adjust_lr_fn,
        adamw_betas=(0.9, 0.95),
    )
    groups = muon_param_groups(torch_model, weight_decay=0.1)
    reference = [
        torch.optim.Muon(
            groups[0]["params"], lr=0.02, weight_decay=0.1, nesterov=nesterov,
            adjust_lr_fn=adjust_lr_fn,
        ),
        torch.optim.AdamW(
            [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups[1:]],
            lr=0.02, betas=(0.9, 0.95),
        ),
    ]  # fmt: skip
    _mlp_steps(ours_model, [ours])
    _mlp_steps(torch_model, reference)
    for (name, a), b in zip(ours_model.named_parameters(), torch_model.parameters()):
        assert torch.equal(a, b), name
    moved = (ours_model[1].weight - _mlp()[1].weight).abs().max().item()
    assert moved > 1e-3  # the steps did something


GQA_CFG = dict(GPT_CFG, n_kv_heads=2)  # two query heads per key / value head


def test_split_qkv_equals_torch_muon_on_separate_projections():
    """split_qkv on the fused projection, against torch.optim.Muon stepping q, k and v as three
    separate parameters (cut and joined by the Hugging Face mapping's functions): same bits."""
    from dist_kernels.models.hf import common as hf

    config = GPTConfig(**GQA_CFG)
    torch.manual_seed(SEED)
    ours_model = GPT(config)
    ref_model = copy.deepcopy(ours_model)
    ours = Muon(
        muon_param_groups(ours_model, 0.1), lr=0.02, split_qkv=True, adamw_betas=(0.9, 0.95)
    )
    groups = muon_param_groups(ref_model, 0.1)
    fused = [b.attn.qkv.weight for b in ref_model.blocks]
    parts = [[t.clone() for t in hf._split_qkv(config, w.detach())] for w in fused]
    others = [p for p in groups[0]["params"] if all(p is not w for w in fused)]
    torch_muon = torch.optim.Muon(
        others + [t for ts in parts for t in ts], lr=0.02, weight_decay=0.1
    )
    adamw = torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups[1:]],
        lr=0.02, betas=(0.9, 0.95),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=gen)
        for model in (ours_model, ref_model):
            model(ids[:, :-1], ids[:, 1:]).backward()
        for w, ts in zip(fused, parts):  # the fused gradient, cut as the weight is
            for t, g in zip(ts, hf._split_qkv(config, w.grad)):
                t.grad = g.clone()
            w.grad = None  # in no optimizer: its gradient would add up
        ours.step()
        torch_muon.step()
        adamw.step()
        with torch.no_grad():
            for w, ts in zip(fused, parts):
                w.copy_(hf._join_qkv(config, *ts))
        for opt in (ours, torch_muon, adamw):
            opt.zero_grad()
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


def test_groups_hold_hidden_matrices_only():
    model = GPT(GPTConfig(**GPT_CFG))
    groups = muon_param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for p in groups[0]["params"])
    assert groups[0]["use_muon"] and muon == sorted(
        n for n, p in model.named_parameters()
        if p.dim() == 2 and not any(k in n for k in ("wte", "wpe", "lm_head"))
    )  # fmt: skip
    assert {names[id(p)] for p in groups[1]["params"]} == {
        "embedding.wte.weight", "embedding.wpe.weight", "head.lm_head.weight"
    }  # fmt: skip
    assert all(p.dim() == 1 for p in groups[2]["params"]) and groups[2]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in groups) == len(names)


def test_state_dict_resume_equals_uninterrupted():
    straight, resumed = _mlp(), _mlp()
    make = lambda m: Muon(muon_param_groups(m), lr=0.01)  # noqa: E731
    opt = make(straight)
    _mlp_steps(straight, [opt], steps=4)
    first = make(resumed)
    _mlp_steps(resumed, [first], steps=2)
    saved = copy.deepcopy(first.state_dict())
    second = make(resumed)
    second.load_state_dict(saved)
    _mlp_steps(resumed, [second], steps=2, start=2)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_deal_is_balanced_and_deterministic():
    gen = torch.Generator().manual_seed(SEED)
    shapes = [tuple(int(x) for x in torch.randint(4, 300, (2,), generator=gen)) for _ in range(37)]
    cost = [r * c * min(r, c) for r, c in shapes]
    for world in (1, 2, 3, 8):
        owner = deal_matrices(shapes, world)
        assert owner == deal_matrices(shapes, world) and set(owner) <= set(range(world))
        load = [sum(c for c, o in zip(cost, owner) if o == r) for r in range(world)]
        assert max(load) - min(load) <= max(cost)  # greedy largest-first: within one matrix
    assert deal_matrices([(2, 2), (64, 64)], 2) == [1, 0]  # the costliest goes first, to rank 0


def test_bad_input_raises_clearly():
    model = _mlp()
    with pytest.raises(ValueError, match=r"shape \(48,\)"):
        Muon([{"params": [model[1].bias]}])  # a bias in a Muon group
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(muon_param_groups(model), adjust_lr_fn="spectral")
    with pytest.raises(ValueError, match="tp_mode"):
        Muon(muon_param_groups(model), tp_mode="distributed")
    with pytest.raises(ValueError, match="momentum"):
        Muon(muon_param_groups(model), momentum=1.0)


# ---------------------------------------------------------------- dp x tp ranks


def _gpt64(cfg=GPT_CFG):
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**cfg)).double()


def _batches(n):
    gen = torch.Generator().manual_seed(SEED + 7)
    shape = (STEPS, n, GPT_CFG["block_size"] + 1)
    ids = torch.randint(0, GPT_CFG["vocab_size"], shape, generator=gen)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _muon(model, **kw):
    return Muon(
        muon_param_groups(model, weight_decay=0.1), lr=0.01, ns_dtype=torch.float64,
        adjust_lr_fn="match_rms_adamw", **kw,
    )  # fmt: skip


def _train(model, opt, mesh, batches):
    """Each dp replica its half of every batch, the gradients averaged over dp, a step."""
    mine = slice(mesh.dp_rank * 2, mesh.dp_rank * 2 + 2)
    for ids, targets in batches:
        model(ids[mine], targets[mine]).backward()
        for p in model.parameters():
            mesh.dp_comm.all_reduce(p.grad, op=dk.ReduceOp.AVG)
        opt.step()
        opt.zero_grad()


def _rank_dp_tp(tp_mode, split_qkv=False):
    """dp 2 x tp 2: gradients averaged over dp, Muon dealt over dp and joined over tp, against
    one process stepping the whole model on the whole batch (float64 throughout; our DDP
    buckets hold FP32 and 16-bit gradients only, so the average is an all-reduce per tensor)."""
    mesh = dk.ProcessMesh(dp=2, tp=2)
    batches = _batches(4)
    reference = _gpt64(GQA_CFG if split_qkv else GPT_CFG)
    ref_opt = _muon(reference, split_qkv=split_qkv)
    for ids, targets in batches:
        reference(ids, targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = _gpt64(GQA_CFG if split_qkv else GPT_CFG).parallelize(mesh.tp_comm)
    opt = _muon(
        model, comm=mesh.dp_comm, tp_comm=mesh.tp_comm, tp_mode=tp_mode, split_qkv=split_qkv
    )
    _train(model, opt, mesh, batches)
    ref = dict(reference.named_parameters())
    diff = {n: (p - shard_of(ref[n], p, mesh.tp_rank)).abs().max().item()
            for n, p in model.named_parameters()}  # fmt: skip
    n_matrices = len(muon_param_groups(model)[0]["params"])
    return {"diff": diff, "mine": opt.last_orthogonalized, "matrices": n_matrices}


@pytest.mark.parametrize("split_qkv", [False, True])
def test_dp2_tp2_equals_one_process_float64(split_qkv):
    print("seed", SEED)
    ranks = run_ranks(4, _rank_dp_tp, "duplicated", split_qkv, timeout=180)
    for rank, r in enumerate(ranks):
        worst = max(r["diff"].values())
        assert worst < 1e-10, (rank, sorted(r["diff"].items(), key=lambda kv: -kv[1])[:3])
    # each matrix orthogonalised by one dp replica (the tp ranks of a replica join on it)
    for tp_rank in (0, 1):
        dealt = [r["mine"] for rank, r in enumerate(ranks) if rank % 2 == tp_rank]
        assert sum(dealt) == ranks[0]["matrices"] and all(0 < d < sum(dealt) for d in dealt)


def test_blockwise_tp_is_another_optimiser():
    """--muon-tp-mode blockwise orthogonalises each tp block alone: the split matrices end
    elsewhere than one process's, by far more than rounding."""
    ranks = run_ranks(4, _rank_dp_tp, "blockwise", timeout=180)
    for r in ranks:
        split = [d for n, d in r["diff"].items() if n.endswith(("qkv.weight", "fc.weight"))]
        assert len(split) == 4 and min(split) > 1e-4, r["diff"]


def _state_numel(opt) -> int:
    return sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim())


def _rank_shard_state():
    """dp 2 x tp 2: shard_state (ZeRO-1 by whole parameters) against replicated state, the
    same operations on the same values: the same bits, half the state per rank; its
    consolidated state dict equals the replicated one; a resume from it is exact."""
    mesh = dk.ProcessMesh(dp=2, tp=2)
    batches = _batches(4)
    comms = dict(comm=mesh.dp_comm, tp_comm=mesh.tp_comm)
    plain = _gpt64().parallelize(mesh.tp_comm)
    plain_opt = _muon(plain, **comms)
    _train(plain, plain_opt, mesh, batches[:2])
    sharded = _gpt64().parallelize(mesh.tp_comm)
    sharded_opt = _muon(sharded, shard_state=True, **comms)
    _train(sharded, sharded_opt, mesh, batches[:2])
    same_after_2 = all(torch.equal(a, b) for a, b in zip(plain.parameters(), sharded.parameters()))
    held = (_state_numel(sharded_opt), _state_numel(plain_opt))
    refused = False
    try:
        sharded_opt.state_dict()
    except RuntimeError as e:
        refused = "consolidate_state_dict" in str(e)
    sharded_opt.consolidate_state_dict()
    whole, reference = sharded_opt.state_dict(), plain_opt.state_dict()
    same_state = whole["state"].keys() == reference["state"].keys() and all(
        torch.equal(whole["state"][i][k], v)
        for i, s in reference["state"].items()
        for k, v in s.items()
    )
    resumed_opt = _muon(sharded, shard_state=True, **comms)
    resumed_opt.load_state_dict(copy.deepcopy(whole))
    held_after_load = _state_numel(resumed_opt)
    _train(sharded, resumed_opt, mesh, batches[2:])
    _train(plain, plain_opt, mesh, batches[2:])
    same_after_4 = all(torch.equal(a, b) for a, b in zip(plain.parameters(), sharded.parameters()))
    return {
        "same": (same_after_2, same_after_4, same_state, refused),
        "held": held,
        "held_after_load": held_after_load,
    }


def test_shard_state_is_replicated_state_in_half_the_memory():
    print("seed", SEED)
    for rank, r in enumerate(run_ranks(4, _rank_shard_state, timeout=180)):
        assert r["same"] == (True, True, True, True), (rank, r["same"])
        mine, whole = r["held"]
        assert 0.3 * whole < mine < 0.7 * whole, (rank, r["held"])  # dealt over 2 replicas
        assert r["held_after_load"] == mine


def _rank_torch_ddp():
    """A torch DDP script (gloo) handing Muon its process group: Newton-Schulz dealt over it,
    state sharded over it, against Muon without a group on the same rank: the same bits."""
    import torch.distributed as dist

    batches = _batches(4)
    mine = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
    results = []
    for kwargs in ({}, {"comm": dist.group.WORLD}, {"comm": dist.group.WORLD, "shard_state": True}):
        model = torch.nn.parallel.DistributedDataParallel(_gpt64())
        opt = _muon(model.module, **kwargs)
        for ids, targets in batches:
            model(ids[mine], targets[mine]).backward()
            opt.step()
            opt.zero_grad()
        opt.consolidate_state_dict()
        state = opt.state_dict()["state"]
        results.append(([p.detach().clone() for p in model.parameters()], state, opt))
    (alone, alone_state, _), (dealt, _, dealt_opt), (sharded, sharded_state, _) = results
    return {
        "dealt": all(torch.equal(a, b) for a, b in zip(alone, dealt)),
        "sharded": all(torch.equal(a, b) for a, b in zip(alone, sharded)),
        "state": all(
            torch.equal(sharded_state[i][k], v)
            for i, s in alone_state.items()
            for k, v in s.items()
        ),
        "mine": dealt_opt.last_orthogonalized,
        "matrices": len(muon_param_groups(_gpt64())[0]["params"]),
    }


def test_a_torch_process_group_serves_as_comm():
    for r in run_ranks(2, _rank_torch_ddp, timeout=180):
        assert (r["dealt"], r["sharded"], r["state"]) == (True, True, True), r
        assert 0 < r["mine"] < r["matrices"]  # the work was dealt over torch's group
