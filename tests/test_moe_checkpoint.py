"""Expert checkpoints across ep sizes (``dk.moe.checkpoint``): an MoE GPT saved per ep rank
(``dk.checkpoint.save(model=...)``, as the driver does) at ep 2 loads at ep 1 and ep 4, and
back, as the same model: every parameter bitwise equal to the original's (the original: each
parameter drawn from a seed of its *global* name, so it is defined whatever the ep), and the
logits bitwise equal to the original's at the loading ep. A run built from another seed would
differ everywhere, so a load that skipped an expert or took it from the wrong rank fails.
Optimizer state (AdamW moments and steps) reshards by name the same way."""

import zlib

import pytest
import torch
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels.models import GPT, GPTConfig
from dist_kernels.moe import checkpoint as moe_ckpt

SEED = 20261207
N_EXPERTS, SEQ = 4, 8


def _model(seed, comm=None):
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=32, block_size=SEQ, n_layers=2, n_heads=2, dim=16, n_experts=N_EXPERTS,
        top_k=2, moe_every=1,
    )  # fmt: skip
    model = GPT(cfg)
    return model.expert_parallel(comm) if comm is not None else model


def _draw(name, shift=0):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + shift)
    return gen


def _original(model):
    """Every parameter from the seed of its global name: the same model at any ep."""
    with torch.no_grad():
        for name, p in zip(moe_ckpt.global_param_names(model), model.parameters()):
            p.copy_(torch.randn(p.shape, generator=_draw(name)) * 0.2)
    return model


def _stepped_optimizer(model):
    """AdamW after one step on gradients drawn from the global names (any ep: same state)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for name, p in zip(moe_ckpt.global_param_names(model), model.parameters()):
        p.grad = torch.randn(p.shape, generator=_draw(name, 1))
    opt.step()
    return opt


def _ids(rank):
    return torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(SEED + rank))


def _state_by_name(model, opt):
    names = moe_ckpt.global_param_names(model)
    return {n: opt.state[p] for n, p in zip(names, model.parameters())}


def _save(model, opt, path):
    extra = {"optimizer": opt.state_dict(), "names": moe_ckpt.global_param_names(model)}
    dk.checkpoint.save(path, model=model, extra=extra)


def _load(model, path_of, saved_ep):
    """``model`` (any ep) from the per-ep-rank checkpoints ``path_of(r)`` of a run at
    ``saved_ep``; returns an AdamW over it holding the resharded state."""
    model.load_state_dict(
        moe_ckpt.reshard_state(model, saved_ep, lambda r: dk.checkpoint.read_model(path_of(r))[0])
    )

    def read_optimizer(r):
        extra = dk.checkpoint.read_model(path_of(r))[1]
        return extra["optimizer"], extra["names"]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(moe_ckpt.reshard_optimizer_state(model, saved_ep, read_optimizer))
    return opt


def _same_everything(loaded, opt, reference, ref_opt, ids):
    """Bitwise: parameters, optimizer state by global name, logits on ``ids``."""
    for (name, p), q in zip(loaded.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    mine, want = _state_by_name(loaded, opt), _state_by_name(reference, ref_opt)
    assert mine.keys() == want.keys()
    for name in want:
        for key, value in want[name].items():
            assert torch.equal(mine[name][key], value), (name, key)
    with torch.no_grad():
        return torch.equal(loaded(ids), reference(ids))


def _paths(root, ep):
    return lambda r: f"{root}/ep{ep}/ep-rank-{r}"


def _rank_at(ep, root, sources):
    """On an ep-sized world: the original at this ep (saved under ``root/ep<ep>``), and
    fresh models loaded from every run in ``sources`` (saved eps), compared with it."""
    import torch.distributed as dist

    mesh = dk.ProcessMesh(dp=dist.get_world_size(), pp=1, ep=ep)
    original = _original(_model(SEED, mesh.ep_comm))
    ref_opt = _stepped_optimizer(original)
    _save(original, ref_opt, _paths(root, ep)(mesh.ep_rank))
    dist.barrier()
    equal = {}
    for saved_ep in sources:
        loaded = _model(SEED + 1, mesh.ep_comm)  # another initialisation: the load must fix all
        opt = _load(loaded, _paths(root, saved_ep), saved_ep)
        equal[saved_ep] = _same_everything(loaded, opt, original, ref_opt, _ids(mesh.ep_rank))
    return equal


def test_experts_reshard_across_ep(tmp_path):
    print("seed", SEED)
    root = str(tmp_path)
    # ep 2 first (nothing to load yet), then ep 1 and ep 4 from it, then ep 2 again from them
    run_ranks(2, _rank_at, 2, root, [])
    single = _rank_at_single(root, [2])
    assert single == {2: True}
    for rank, equal in enumerate(run_ranks(4, _rank_at, 4, root, [2, 1])):
        assert equal == {2: True, 1: True}, rank
    for rank, equal in enumerate(run_ranks(2, _rank_at, 2, root, [4, 1])):
        assert equal == {4: True, 1: True}, rank
    assert _rank_at_single(root, [4, 2]) == {4: True, 2: True}


def _rank_at_single(root, sources):
    """ep 1 in this process: every expert local, no communicator."""
    original = _original(_model(SEED))
    ref_opt = _stepped_optimizer(original)
    _save(original, ref_opt, _paths(root, 1)(0))
    equal = {}
    for saved_ep in sources:
        loaded = _model(SEED + 1)
        opt = _load(loaded, _paths(root, saved_ep), saved_ep)
        equal[saved_ep] = _same_everything(loaded, opt, original, ref_opt, _ids(0))
    return equal


def test_reshard_names_what_is_missing(tmp_path):
    """A saved rank without the expert asked for: a KeyError naming the keys; an ep that does
    not divide the experts: the arithmetic."""
    model = _original(_model(SEED))
    state = dict(model.state_dict())
    del state["blocks.1.mlp.experts.3.w2.weight"]
    with pytest.raises(KeyError, match=r"lack 1 keys .*blocks\.1\.mlp\.experts\.3\.w2\.weight"):
        moe_ckpt.reshard_state(_model(SEED), 1, lambda r: state)
    with pytest.raises(ValueError, match=r"ep\(3\) must divide the 4 experts of blocks\.0\.mlp"):
        moe_ckpt.saved_ranks(model, 3)


# ------------------------------------------------------------------ ZeRO shards of expert groups


def _zero_optimizer(model, mesh, ep, stage):
    return dk.ShardedOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        mesh.dp_comm,
        stage=stage,
        expert_comm=mesh.expert_dp_comm if ep > 1 else None,
        bucket_cap_mb=0.004,  # several buckets a group
        lr=1e-2,
    )


def _zero_step(model, opt, shift, ep):
    """One AdamW step on gradients drawn from the global names, whatever the ep: an expert's
    gradient is averaged over its ep-times-fewer replicas but divided by all data ranks (1 / ep,
    ShardedOptimizer's expert scaling), so it is drawn ep times larger to reach the same value."""
    opt.zero_grad()
    loss = torch.zeros(())
    for name, p in zip(moe_ckpt.global_param_names(model), model.parameters()):
        scale = ep if getattr(p, "expert_parallel", False) else 1
        loss = loss + (p * torch.randn(p.shape, generator=_draw(name, shift))).sum() * scale
    loss.backward()
    opt.step()


def _by_global_name(model):
    names = moe_ckpt.global_param_names(model)
    return {n: p.detach().clone() for n, p in zip(names, model.parameters())}


def _rank_zero_saves(root):
    """dp 4 x ep 2, ZeRO stage 2: one step, the checkpoint, a second step."""
    mesh = dk.ProcessMesh(dp=4, pp=1, ep=2)
    model = _original(_model(SEED, mesh.ep_comm))
    opt = _zero_optimizer(model, mesh, 2, 2)
    _zero_step(model, opt, 1, 2)
    saved = _by_global_name(model)
    dk.checkpoint.save(root, model=model, optimizer=opt)
    _zero_step(model, opt, 2, 2)
    return saved, _by_global_name(model)


def _rank_zero_loads(root, ep, stage):
    """A fresh model at dp 4 x ``ep`` loads the shards (model alone, then with the ZeRO
    optimizer) and takes the second step."""
    mesh = dk.ProcessMesh(dp=4, pp=1, ep=ep)
    model = _model(SEED + 1, mesh.ep_comm if ep > 1 else None)
    dk.checkpoint.load(root, model=model)
    model_only = _by_global_name(model)
    model = _model(SEED + 2, mesh.ep_comm if ep > 1 else None)
    opt = _zero_optimizer(model, mesh, ep, stage)
    dk.checkpoint.load(root, model=model, optimizer=opt)
    loaded = _by_global_name(model)
    _zero_step(model, opt, 2, ep)
    return model_only, loaded, _by_global_name(model)


def test_zero_shards_of_expert_groups_reshard_across_ep(tmp_path):
    """ZeRO over expert groups (experts sharded over their replicas, each ep rank's its own)
    saved at ep 2 loads at ep 1, 2 and 4 and stages 1, 2: parameters bitwise the saved ones
    (the model alone too), and the next step (AdamW moments and step count from the shards)
    equal to the saving run's to FP32 rounding of the dense average."""
    print("seed", SEED)
    root = str(tmp_path / "zero")
    saved_runs = run_ranks(4, _rank_zero_saves, root, timeout=300)
    saved, stepped = {}, {}
    for before, after in saved_runs:  # each rank holds its own experts and the dense weights
        saved.update(before)
        stepped.update(after)
    assert len(saved) == len(_by_global_name(_model(SEED)))  # every expert, by global id
    for ep, stage in ((4, 1), (1, 2), (2, 1)):
        for model_only, loaded, after in run_ranks(4, _rank_zero_loads, root, ep, stage):
            for name, value in loaded.items():
                assert torch.equal(model_only[name], saved[name]), (ep, name)
                assert torch.equal(value, saved[name]), (ep, stage, name)
                err = float((after[name] - stepped[name]).abs().max())
                assert err <= 1e-6, (ep, stage, name, err)
