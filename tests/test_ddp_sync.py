"""When DDP synchronises (set_requires_gradient_sync against no_sync), modules it refuses, and
the 1-rank short circuit, each against an independent reference.

References: per-rank gradients computed by a plain copy of the model (every rank can compute
every rank's, the data come from a seeded generator), averaged in float64; torch DDP (gloo) for
which modules are refused; plain single-process training (with a LossScaler) for one rank.
"""

from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.nn as nn
from mp_pool import run_ranks
from test_ddp import MLP, SEED, Branchy, Mixed, _init_comm, _params

RTOL = 1e-5  # float32 gradients averaged over 2 ranks, against a float64 mean


def _data(world: int, batches: int) -> List[List[torch.Tensor]]:
    """``batches`` inputs per rank, identical on every rank: [batch][rank]."""
    gen = torch.Generator().manual_seed(SEED + 7)
    return [[torch.randn(3, 16, generator=gen) for _ in range(world)] for _ in range(batches)]


def _local_grads(base: nn.Module, xs: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Gradients of the summed losses of ``xs`` on a plain copy (float64 accumulation)."""
    model = copy.deepcopy(base).double()
    for x in xs:
        model(x.double()).square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _mean_grads(base: nn.Module, per_rank: List[List[torch.Tensor]]) -> Dict[str, torch.Tensor]:
    grads = [_local_grads(base, xs) for xs in per_rank]
    return {n: sum(g[n] for g in grads) / len(grads) for n in grads[0]}


def _err(model: nn.Module, expected: Dict[str, torch.Tensor]) -> float:
    """Largest difference of ``.grad`` from ``expected``, relative to its largest entry."""
    inner = getattr(model, "module", model)
    scale = max(g.abs().max().item() for g in expected.values())
    return max(
        (p.grad.double() - expected[n]).abs().max().item() / scale
        for n, p in inner.named_parameters()
    )


def _sync_cases() -> Dict[str, object]:
    """Each scenario on a fresh DDP: (relative error against its reference, reductions)."""
    import torch.distributed as dist

    import dist_kernels as dk

    _init_comm()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    base = MLP()
    data = _data(world, 3)
    mine = [batch[rank] for batch in data]

    def run(scenario) -> tuple:
        model = dk.DDP(copy.deepcopy(base), bucket_cap_mb=0.004, first_bucket_mb=0.001)
        per_pass = len(model.bucket_layouts)
        reference = scenario(model)
        return _err(model, reference), model.reductions_launched / per_pass

    def loss(model, i):
        return model(mine[i]).square().mean()

    def local(*batches):
        return _local_grads(base, [mine[i] for i in batches])

    def mean(*batches):
        return _mean_grads(base, [[data[i][r] for i in batches] for r in range(world)])

    def forward_in_no_sync_then_enable(model):
        with model.no_sync():
            out = loss(model, 0)
        model.set_requires_gradient_sync(True)
        out.backward()  # outside the forward's no_sync(): synchronises because of the switch
        return mean(0)

    def forward_in_no_sync_backward_outside(model):
        with model.no_sync():
            out = loss(model, 0)
        out.backward()  # the forward decided: local, as in torch DDP
        return local(0)

    def armed_forward_then_disable(model):
        out = loss(model, 0)
        model.set_requires_gradient_sync(False)
        out.backward()
        return local(0)

    def fsdp2_accumulation(model):  # the switch persists over forwards, as in FSDP2
        for i in range(3):
            model.set_requires_gradient_sync(i == 2)
            loss(model, i).backward()
        return mean(0, 1, 2)

    def one_f_one_b(model):  # micro-batch 1's forward runs last but its backward does not
        with model.no_sync():
            out0 = loss(model, 0)
        out1 = loss(model, 1)
        model.set_requires_gradient_sync(False)
        out0.backward()
        model.set_requires_gradient_sync(True)
        out1.backward()
        return mean(0, 1)

    def no_grad_forward_keeps_decision(model):
        out = loss(model, 0)
        with torch.no_grad():
            model(mine[1])
        out.backward()
        return mean(0)

    def second_backward_is_local(model):  # a synchronised backward disarms
        out = loss(model, 0)
        out.backward(retain_graph=True)
        out.backward()
        reduced, own = mean(0), local(0)
        return {n: reduced[n] + own[n] for n in reduced}

    scenarios = [
        forward_in_no_sync_then_enable,
        forward_in_no_sync_backward_outside,
        armed_forward_then_disable,
        fsdp2_accumulation,
        one_f_one_b,
        no_grad_forward_keeps_decision,
        second_backward_is_local,
    ]
    out: Dict[str, object] = {s.__name__: run(s) for s in scenarios}
    # The scenarios without the switch follow torch DDP's forward-time rule: check it there too.
    for scenario in (forward_in_no_sync_backward_outside, no_grad_forward_keeps_decision):
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        out["torch " + scenario.__name__] = _err(theirs, scenario(theirs))
    # find_unused_parameters: a no_sync() forward records no unused parameters, so the end of
    # the backward the switch enables must find them (torch DDP, run plainly, is the reference).
    branchy = Branchy()
    branchy.skip_b = rank == 1
    ours = dk.DDP(copy.deepcopy(branchy), find_unused_parameters=True)
    theirs = nn.parallel.DistributedDataParallel(
        copy.deepcopy(branchy), find_unused_parameters=True
    )
    with ours.no_sync():
        out0 = ours(mine[0]).sum()
    ours.set_requires_gradient_sync(True)
    out0.backward()
    theirs(mine[0]).sum().backward()
    grads = [dict(m.module.named_parameters()) for m in (ours, theirs)]
    out["unused_none"] = [n for n, p in grads[0].items() if p.grad is None]
    out["unused_none_torch"] = [n for n, p in grads[1].items() if p.grad is None]
    out["unused_diff"] = max(
        (p.grad - grads[1][n].grad).abs().max().item()
        for n, p in grads[0].items()
        if p.grad is not None
    )
    model = dk.DDP(copy.deepcopy(base))
    try:
        model.set_requires_gradient_sync(1)
        out["type_error"] = "no error"
    except TypeError as e:
        out["type_error"] = str(e)
    return out


def test_set_requires_gradient_sync_against_no_sync():
    print(f"seed {SEED}")
    results = run_ranks(2, _sync_cases, timeout=120)
    expected_reductions = {  # in passes of every bucket
        "forward_in_no_sync_then_enable": 1,
        "forward_in_no_sync_backward_outside": 0,
        "armed_forward_then_disable": 0,
        "fsdp2_accumulation": 1,
        "one_f_one_b": 1,
        "no_grad_forward_keeps_decision": 1,
        "second_backward_is_local": 1,
    }
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        for name, passes in expected_reductions.items():
            err, launched = r[name]
            assert err < RTOL, (rank, name, err)
            assert launched == passes, (rank, name, launched)
        assert "requires_gradient_sync: expected a bool" in r["type_error"]
        assert r["unused_none"] == r["unused_none_torch"] == ["never.weight", "never.bias"]
        assert r["unused_diff"] < 1e-6, r["unused_diff"]
        assert r["torch forward_in_no_sync_backward_outside"] < RTOL
        assert r["torch no_grad_forward_keeps_decision"] < RTOL


# ----------------------------------------------------------------------------- refused modules


class _BuffersOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(3))


def _refusal_cases() -> Dict[str, tuple]:
    """(torch DDP refuses, our message or "accepted") per module kind, on every rank."""
    import torch.distributed as dist

    import dist_kernels as dk

    _init_comm()
    rank = dist.get_rank()
    frozen_on_rank1 = nn.Linear(4, 4)
    frozen_on_rank1.bias.requires_grad_(rank != 1)
    modules = {
        "empty": lambda: nn.Module(),
        "buffers_only": _BuffersOnly,
        "frozen_only": lambda: nn.Linear(4, 4).requires_grad_(False),
        "partly_frozen": lambda: nn.Sequential(
            nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 2)
        ),
        "trainable": lambda: nn.Linear(4, 4),
        "frozen_differs": lambda: frozen_on_rank1,
    }
    out = {}
    for name, make in modules.items():
        if name == "frozen_differs":  # torch DDP does not compare requires_grad across ranks
            torch_refuses = None
        else:
            try:
                nn.parallel.DistributedDataParallel(make())
                torch_refuses = False
            except RuntimeError:
                torch_refuses = True
        try:
            dk.DDP(make())
            ours = "accepted"
        except ValueError as e:
            ours = str(e)
        out[name] = (torch_refuses, ours)
    return out


def test_modules_without_trainable_parameters_are_refused_on_every_rank():
    results = run_ranks(2, _refusal_cases, timeout=60)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        for name in ("empty", "buffers_only", "frozen_only", "partly_frozen", "trainable"):
            torch_refuses, ours = r[name]
            assert torch_refuses == (ours != "accepted"), (name, r[name])
            if torch_refuses:
                assert ours.startswith(f"[rank {rank}] DistributedDataParallel:"), ours
        assert "no parameters and no buffers" in r["empty"][1]
        assert "1 buffer(s) but no parameters" in r["buffers_only"][1]
        assert "none of the module's 2 parameters requires a gradient" in r["frozen_only"][1]
        # requires_grad differing across ranks: every rank raises instead of one hanging.
        assert "bias (4,) float32 frozen" in r["frozen_differs"][1], r["frozen_differs"]


# ----------------------------------------------------------------------------- one rank


def _train_one_rank(model, opt, scaler, batches, micro: int, inf_step: int) -> List[bool]:
    """Steps with ``micro`` micro-batches (all but the last under no_sync when DDP)."""
    flags = []
    for step, (x, y) in enumerate(batches):
        x = x.clone()
        if step == inf_step:
            x[0, 0] = float("inf")
        for i, (xc, yc) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            quiet = i < micro - 1 and hasattr(model, "no_sync")
            with model.no_sync() if quiet else torch.enable_grad():
                loss = nn.functional.mse_loss(model(xc), yc) / micro
                (scaler.scale(loss) if scaler else loss).backward()
        if hasattr(model, "found_inf"):
            flags.append(model.found_inf)
        else:  # the reference: inf/NaN in any gradient
            flags.append(not all(bool(p.grad.isfinite().all()) for p in model.parameters()))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return flags


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN matching NaN (an unscaled inf step makes NaN parameters)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _one_rank_training() -> Dict[str, object]:
    """DDP on one rank against the same training without DDP: identical parameters."""
    import dist_kernels as dk

    _init_comm()
    gen = torch.Generator().manual_seed(SEED + 3)
    batches = [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in "abcd"
    ]
    out: Dict[str, object] = {}
    options = {
        "plain": {},
        "bf16_wire_predivide": {"grad_dtype": torch.bfloat16, "gradient_predivide_factor": 4.0},
    }
    for name, kwargs in options.items():
        for use_scaler in (False, True):
            runs = []
            for engine in ("ddp", "plain"):
                torch.manual_seed(SEED)
                model = MLP()
                scaler = dk.LossScaler(init_scale=2.0**8, growth_interval=2) if use_scaler else None
                if engine == "ddp":
                    model = dk.DDP(model, loss_scaler=scaler, **kwargs)
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                flags = _train_one_rank(model, opt, scaler, batches, micro=2, inf_step=1)
                state = (scaler.get_scale(), scaler.skipped_steps) if scaler else None
                runs.append((_params(model), flags, state, model))
            (ours, flags, state, ddp), (plain, ref_flags, ref_state, _) = runs
            out[f"{name} scaler={use_scaler}"] = {
                "equal": all(_same(ours[n], plain[n]) for n in plain),
                "found_inf": (flags, ref_flags),
                "scaler": (state, ref_state),
                "buckets": (len(ddp.buckets), len(ddp.bucket_layouts), ddp.reductions_launched),
            }
    return out


def _one_rank_behaviour() -> Dict[str, object]:
    """Errors, unused parameters, strided gradients and state_dict keys on one rank."""
    import dist_kernels as dk

    _init_comm()
    torch.manual_seed(SEED)
    x = torch.randn(4, 16)
    out: Dict[str, object] = {}
    try:  # a parameter without a gradient, without find_unused_parameters
        dk.DDP(Branchy())(x).sum().backward()
        out["unused_error"] = "no error"
    except RuntimeError as e:
        out["unused_error"] = str(e)
    base = Branchy()
    base.skip_b = True
    ours, theirs = dk.DDP(copy.deepcopy(base), find_unused_parameters=True), copy.deepcopy(base)
    ours(x).sum().backward()
    theirs(x).sum().backward()
    out["unused_none"] = sorted(n for n, p in ours.module.named_parameters() if p.grad is None)
    out["unused_none_ref"] = sorted(n for n, p in theirs.named_parameters() if p.grad is None)
    # Strided (transposed) and BF16 parameters, unscaled for the LossScaler.
    mixed = Mixed()
    reference = copy.deepcopy(mixed)
    grads = []
    for model in (dk.DDP(mixed, loss_scaler=dk.LossScaler()), reference):
        scaler = getattr(model, "loss_scaler", None) or dk.LossScaler()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(x).square().mean()).backward()
        if model is reference:
            scaler.unscale_(opt)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    out["mixed_equal"] = all(
        torch.equal(grads[0]["module." + n], g) for n, g in grads[1].items()
    ) and len(grads[0]) == len(grads[1])
    # Two synchronised backward passes before update() would unscale the first one twice.
    model = dk.DDP(MLP(), loss_scaler=dk.LossScaler())
    try:
        for _ in range(2):
            model.loss_scaler.scale(model(x).sum()).backward()
        out["double_unscale"] = "no error"
    except RuntimeError as e:
        out["double_unscale"] = str(e)
    # A backward hook calling the switch mid-backward.
    model = dk.DDP(MLP())
    try:
        out_tensor = model(x)
        model.module.fc1.weight.register_hook(lambda g: model.set_requires_gradient_sync(False))
        out_tensor.sum().backward()
        out["switch_in_backward"] = "no error"
    except RuntimeError as e:
        out["switch_in_backward"] = str(e)
    # state_dict keys as torch DDP's.
    module = MLP(batch_norm=True)
    ours = dk.DDP(copy.deepcopy(module))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    out["keys_match"] = list(ours.state_dict()) == list(theirs.state_dict())
    # ShardedOptimizer refuses a DDP's parameters (it would reduce them a second time).
    try:
        dk.ShardedOptimizer(ours.parameters(), stage=2, lr=0.1)
        out["zero_refuses_ddp"] = "no error"
    except ValueError as e:
        out["zero_refuses_ddp"] = str(e)
    return out


def test_one_rank_matches_training_without_ddp():
    print(f"seed {SEED}")
    (result,) = run_ranks(1, _one_rank_training, timeout=120)
    for name, case in result.items():
        print(f"{name}: {case}")
        assert case["equal"], name
        assert case["buckets"] == (0, 0, 0), name  # nothing packed or reduced
        flags, ref_flags = case["found_inf"]
        assert flags == ref_flags and flags[:2] == [False, True], name
        assert case["scaler"][0] == case["scaler"][1], name


def test_one_rank_errors_unused_strided_and_keys():
    (r,) = run_ranks(1, _one_rank_behaviour, timeout=60)
    print(r)
    assert (
        "[rank 0] DistributedDataParallel: these parameters received no gradient"
        in (r["unused_error"])
    ), r["unused_error"]
    assert "'never.weight', 'never.bias'" in r["unused_error"], r["unused_error"]
    assert r["unused_none"] == r["unused_none_ref"]
    assert r["unused_none"] == ["b.bias", "b.weight", "never.bias", "never.weight"]
    assert r["mixed_equal"]
    assert "already unscaled since the last update()" in r["double_unscale"], r
    assert "called during a synchronised backward" in r["switch_in_backward"], r
    assert r["keys_match"]
    assert "belong to a dist_kernels.DistributedDataParallel" in r["zero_refuses_ddp"], r
