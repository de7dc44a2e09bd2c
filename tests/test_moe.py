"""Mixture of experts: the unsharded layer against a float64 loop reference built from torch
ops (outputs, every gradient, the aux loss as Megatron's switch_load_balancing_loss_func, the
z-loss by its definition, both drop policies); the layer sharded over ep = 2 and 4 against the
unsharded one (no drops, with capacity, adversarial routing); errors with the arithmetic."""

import math

import pytest
import torch
import torch.nn.functional as F
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels.moe import MoE, shard_experts

SEED = 20261203
DIM, FFN, EXPERTS = 8, 12, 8
# float64 throughout: each value is a sum of at most FFN * DIM products of O(1) terms, so the
# rounding error is ~ FFN * DIM * 2^-53 ~ 1e-14, under the 1e-12 bar.
TOL = 1e-12


def _make_layer(seed, top_k, router="softmax", capacity=None, policy="probs", z=1e-3):
    """``router`` "softmax-norm": softmax with the top-k weights renormalised (Mixtral)."""
    torch.manual_seed(seed)
    return MoE(
        DIM,
        FFN,
        EXPERTS,
        top_k,
        None,
        capacity,
        router.removesuffix("-norm"),
        aux_loss_coeff=1e-2,
        z_loss_coeff=z,
        drop_policy=policy,
        norm_topk=router.endswith("-norm"),
    ).double()


def _tokens(case, rank, ep, seed):
    """This rank's tokens for a routing case (every rank draws every rank's, keeps its own)."""
    gen = torch.Generator().manual_seed(seed)
    counts = {"random": [13] * ep, "one_token": [1] * ep, "empty_rank": [9] + [0] * (ep - 1)}
    counts["one_expert"] = counts["random"]
    xs = [torch.randn(n, DIM, generator=gen, dtype=torch.float64) for n in counts[case]]
    if case == "one_expert":
        xs = [x.abs() for x in xs]
    return xs[rank]


def _route_to_one_expert(layer):
    """Logit of expert e = (1 if e == 0 else -e) * sum(x): with x >= 0 every token picks
    experts 0, 1, ..., k-1 in that order (all on ep rank 0)."""
    with torch.no_grad():
        for e in range(EXPERTS):
            layer.router.weight[e].fill_(1.0 if e == 0 else -float(e))


# ------------------------------------------------------------------ the float64 reference


def _expert(x, e, layer):
    ex = layer.experts[e]
    return F.linear(F.silu(F.linear(x, ex.w1.weight)) * F.linear(x, ex.w3.weight), ex.w2.weight)


def _reference(layer, x):
    """y and the total aux loss, token by token, from the module docstring's definitions."""
    r, T, k = layer.router, x.shape[0], layer.top_k
    logits = x @ r.weight.t()
    chosen = []  # (token, slot, expert, weight)
    balance = []
    for t in range(T):
        s = torch.softmax(logits[t], -1) if r.kind == "softmax" else torch.sigmoid(logits[t])
        top, idx = torch.topk(s, k)
        w = top / top.sum() if r.kind == "sigmoid" or r.norm_topk else top
        balance.append(s if r.kind == "softmax" else s / s.sum())
        chosen += [(t, j, int(idx[j]), w[j]) for j in range(k)]
    kept = _apply_capacity(chosen, T, k, r)
    y = [torch.zeros(DIM, dtype=x.dtype) for _ in range(T)]
    for t, _, e, w in kept:
        y[t] = y[t] + w * _expert(x[t], e, layer)
    if T == 0:
        return x.new_zeros(0, DIM) + 0 * r.weight.sum(), 0 * r.weight.sum()
    # Switch: E * sum_e f_e * P_e, f_e the fraction of the k*T assignments, P_e the mean score.
    frac = [sum(1 for c in chosen if c[2] == e) / (k * T) for e in range(EXPERTS)]
    mean_p = [sum(b[e] for b in balance) / T for e in range(EXPERTS)]
    lb = r.aux_loss_coeff * EXPERTS * sum(f * p for f, p in zip(frac, mean_p))
    lse = [torch.log(torch.exp(logits[t]).sum()) for t in range(T)]
    zl = r.z_loss_coeff * sum(v * v for v in lse) / T
    return torch.stack(y), lb + zl


def _apply_capacity(chosen, T, k, r):
    if r.capacity_factor is None:
        return chosen
    capacity = math.ceil(T * k / EXPERTS * r.capacity_factor)
    kept = []
    for e in range(EXPERTS):
        mine = [c for c in chosen if c[2] == e]  # token order
        if r.drop_policy == "probs":
            mine = sorted(mine, key=lambda c: -float(c[3].detach()))  # stable: ties keep order
        kept += mine[:capacity]
    return kept


def _grads(layer, x, y, aux, g):
    """(x.grad, router grad, expert grads by expert id) of sum(y * g) + aux."""
    params = [layer.router.weight, *layer.experts.parameters()]
    grads = torch.autograd.grad((y * g).sum() + aux, [x, *params], allow_unused=True)
    grads = [torch.zeros_like(p) if d is None else d for d, p in zip(grads, [x, *params])]
    return grads[0], grads[1], grads[2:]


def _max_error(a, b):
    return max((float((p - q).abs().max()) if p.numel() else 0.0) for p, q in zip(a, b))


@pytest.mark.parametrize(
    "router, capacity, policy, top_k",
    [
        ("softmax", None, "probs", 2),
        ("sigmoid", None, "probs", 2),
        ("softmax", 1.0, "probs", 2),
        ("softmax", 0.5, "position", 2),
        ("sigmoid", 1.25, "probs", 3),
        ("softmax", None, "probs", EXPERTS),
        ("softmax-norm", None, "probs", 2),
        ("softmax-norm", 0.75, "probs", 3),
    ],
)
def test_unsharded_layer_equals_the_reference(router, capacity, policy, top_k):
    print("seed", SEED)
    layer = _make_layer(SEED, top_k, router, capacity, policy)
    gen = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(37, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(37, DIM, generator=gen, dtype=torch.float64)
    y = layer(x)
    ours = _grads(layer, x, y, layer.aux_loss, g)
    y_ref, aux_ref = _reference(layer, x)
    theirs = _grads(layer, x, y_ref, aux_ref, g)
    assert float((y - y_ref).detach().abs().max()) <= TOL
    assert abs(float((layer.aux_loss - aux_ref).detach())) <= TOL
    assert _max_error([ours[0], ours[1], *ours[2]], [theirs[0], theirs[1], *theirs[2]]) <= TOL
    stats = layer.last_stats
    assert sum(stats["tokens_per_expert"]) + stats["dropped"] == 37 * top_k
    if capacity is None:
        assert stats["dropped"] == 0
    else:
        cap = math.ceil(37 * top_k / EXPERTS * capacity)
        assert max(stats["tokens_per_expert"]) <= cap


@pytest.mark.parametrize("gate", [False, True], ids=["shared", "shared-gated"])
def test_shared_expert_adds_its_mlp_to_every_token(gate):
    """A shared expert (DeepSeek's; with the sigmoid gate Qwen2-MoE's): the routed reference
    plus ``w2(silu(w1 x) * w3 x)``, times ``sigmoid(x . g)`` when gated, for every token;
    every gradient, the shared weights' included, against that float64 definition; and the
    layer sharded over ep 2 holds the same shared expert on both ranks, not expert_parallel."""
    print("seed", SEED)
    torch.manual_seed(SEED)
    layer = MoE(DIM, FFN, EXPERTS, 2, aux_loss_coeff=1e-2, shared_ffn_dim=10, shared_gate=gate)
    layer = layer.double()
    gen = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(23, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(23, DIM, generator=gen, dtype=torch.float64)
    sx = layer.shared_expert
    shared_params = [*sx.parameters(), *([layer.shared_expert_gate.weight] if gate else [])]
    routed, aux = _reference(layer, x)
    mlp = F.linear(F.silu(F.linear(x, sx.w1.weight)) * F.linear(x, sx.w3.weight), sx.w2.weight)
    scale = torch.sigmoid(x @ layer.shared_expert_gate.weight.t()) if gate else 1.0
    want = routed + scale * mlp
    y = layer(x)
    params = [x, layer.router.weight, *layer.experts.parameters(), *shared_params]
    ours = torch.autograd.grad((y * g).sum() + layer.aux_loss, params)
    theirs = torch.autograd.grad((want * g).sum() + aux, params)
    assert float((y - want).detach().abs().max()) <= TOL
    assert _max_error(ours, theirs) <= TOL
    assert float((y - routed).detach().abs().min()) > 0  # every token got its share
    names = [n for n, _ in layer.named_parameters()]
    assert "shared_expert.w1.weight" in names and ("shared_expert_gate.weight" in names) == gate


def _rank_shared(gate):
    comm = dk.Communicator()
    torch.manual_seed(SEED)
    dense = MoE(DIM, FFN, EXPERTS, 2, shared_ffn_dim=10, shared_gate=gate).double()
    moe = shard_experts(dense, comm)
    x = _tokens("random", comm.rank, comm.world_size, SEED)
    with torch.no_grad():
        error = float((moe(x) - dense(x)).abs().max())
    shared = [n for n, p in moe.named_parameters() if n.startswith("shared")]
    marked = [n for n, p in moe.named_parameters() if getattr(p, "expert_parallel", False)]
    return error, shared, marked


def test_sharded_layer_keeps_the_shared_expert_dense():
    for error, shared, marked in run_ranks(2, _rank_shared, True, timeout=300):
        assert error <= TOL
        assert shared == ["shared_expert.w1.weight", "shared_expert.w2.weight",
                          "shared_expert.w3.weight", "shared_expert_gate.weight"]  # fmt: skip
        assert marked and all(n.startswith("experts.") for n in marked)


def test_aux_loss_is_megatrons_formula():
    """switch_load_balancing_loss_func: sum(probs.sum(0) * tokens_per_expert) * E * coeff /
    (k * T^2), with tokens_per_expert the routing map's column sums; z-loss by definition."""
    layer = _make_layer(SEED + 2, 2, z=0.0)
    x = torch.randn(21, DIM, dtype=torch.float64)
    layer(x)
    probs = torch.softmax(x @ layer.router.weight.t(), -1)
    routing_map = torch.zeros(21, EXPERTS).scatter(1, torch.topk(probs, 2).indices, 1.0)
    tpe = routing_map.sum(0).double()
    want = (probs.sum(0) * tpe).sum() * (EXPERTS * 1e-2 / (2 * 21 * 21))
    assert abs(float((layer.aux_loss - want).detach())) <= TOL
    logits = x @ layer.router.weight.t()
    want_z = torch.logsumexp(logits, -1).square().mean() * 0.5
    assert abs(float((dk.moe.z_loss(logits, 0.5) - want_z).detach())) <= TOL


# ------------------------------------------------------------------ sharded over ep ranks

CASES = [
    # (routing case, router, capacity_factor, drop_policy, top_k)
    ("random", "softmax", None, "probs", 2),
    ("random", "sigmoid", None, "probs", 2),
    ("random", "softmax", 1.0, "probs", 2),
    ("random", "softmax", 0.75, "position", 3),
    ("one_expert", "softmax", None, "probs", 2),
    ("one_expert", "softmax", 1.0, "probs", 2),
    ("one_token", "softmax", None, "probs", 2),
    ("empty_rank", "sigmoid", None, "probs", 2),
    ("random", "softmax", None, "probs", EXPERTS),
    ("random", "softmax-norm", None, "probs", 2),
    ("random", "softmax-norm", 1.0, "probs", 2),
]


def _rank_sharded(cases):
    comm = dk.Communicator()
    rank, ep = comm.rank, comm.world_size
    errors = []
    for i, (case, router, capacity, policy, top_k) in enumerate(cases):
        seed = SEED + 100 * i
        dense = _make_layer(seed, top_k, router, capacity, policy)
        if case == "one_expert":
            _route_to_one_expert(dense)
        moe = shard_experts(dense, comm)
        assert moe.local_expert_ids == list(range(rank * EXPERTS // ep, (rank + 1) * EXPERTS // ep))
        xs = [_tokens(case, q, ep, seed) for q in range(ep)]
        gs = [torch.randn_like(x) for x in xs]  # the same draws on every rank (global seed)
        x = xs[rank].clone().requires_grad_()
        y = moe(x)
        ours = _grads(moe, x, y, moe.aux_loss, gs[rank])
        # The unsharded layer on each rank's tokens (drops are per rank, before the exchange);
        # an expert's gradient is the sum over every rank's tokens.
        refs = []
        for q in range(ep):
            xq = xs[q].clone().requires_grad_()
            yq = dense(xq)
            refs.append((yq, _grads(dense, xq, yq, dense.aux_loss, gs[q])))
        want_y, want = refs[rank]
        summed = [sum(r[1][2][j] for r in refs) for j in range(len(want[2]))]
        local = [p for e in moe.local_expert_ids for p in summed[3 * e : 3 * e + 3]]
        stats = moe.last_stats
        assert sum(stats["tokens_per_expert"]) + stats["dropped"] == sum(len(x) for x in xs) * top_k
        error = _max_error([y, ours[0], ours[1], *ours[2]], [want_y, want[0], want[1], *local])
        errors.append((case, router, capacity, top_k, error))
    return errors


@pytest.mark.parametrize("ep", (2, 4))
def test_sharded_layer_equals_the_unsharded_one(ep):
    print("seed", SEED)
    for rank_errors in run_ranks(ep, _rank_sharded, CASES, timeout=300):
        for *case, error in rank_errors:
            assert error <= TOL, (case, error)


def _rank_compiled(cases):
    """The sharded layer compiled (torch.compile, aot_eager: dynamo's graphs through
    AOTAutograd, torch's kernels) against the same layer eager: output and every gradient."""
    torch._dynamo.reset()  # a fresh cache: earlier compiles in this worker do not count
    comm = dk.Communicator()
    rank, ep = comm.rank, comm.world_size
    errors = []
    for i, (case, router, capacity, policy, top_k) in enumerate(cases):
        seed = SEED + 100 * i
        moe = shard_experts(_make_layer(seed, top_k, router, capacity, policy), comm)
        compiled = torch.compile(moe, backend="aot_eager")
        x = _tokens(case, rank, ep, seed)
        g = torch.randn_like(x)
        results = []
        for layer in (moe, compiled):
            xr = x.clone().requires_grad_()
            y = layer(xr)
            grad_x, grad_router, grad_experts = _grads(moe, xr, y, moe.aux_loss, g)
            results.append([y, grad_x, grad_router, *grad_experts])
        errors.append((case, _max_error(*results)))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return errors, graphs


def test_compiled_sharded_layer_equals_the_eager_one():
    """torch.compile of an expert-parallel layer: the router compiles, the token exchange runs
    eagerly between graphs (it raised inside dynamo before), and the results are the eager
    layer's."""
    print("seed", SEED)
    cases = [("random", "softmax", None, "probs", 2), ("random", "sigmoid", 1.0, "probs", 2)]
    for errors, graphs in run_ranks(2, _rank_compiled, cases, timeout=300):
        assert graphs > 0  # dynamo compiled something: the test ran the compiled path
        for case, error in errors:
            assert error <= TOL, (case, error)


# ------------------------------------------------------------------ bad input


class _FakeComm:
    def __init__(self, world_size, rank=0, num_hosts=1):
        self.world_size, self.rank, self.num_hosts = world_size, rank, num_hosts


@pytest.mark.parametrize(
    "kwargs, comm, message",
    [
        ({"n_experts": 8}, _FakeComm(3, 1), r"\[rank 1\] MoE: n_experts\(8\) % ep\(3\) = 2"),
        ({"n_experts": 4, "top_k": 5}, None, r"top_k\(5\) must be in \[1, n_experts\(4\)\]"),
        ({"n_experts": 8}, _FakeComm(4, 2, num_hosts=2), r"ep group spans 2 hosts \(4 ranks\)"),
        ({"router": "relu"}, None, r"router must be one of"),
        ({"drop_policy": "random"}, None, r"drop_policy must be one of"),
        ({"capacity_factor": 0.0}, None, r"capacity_factor must be > 0"),
        ({"shared_gate": True}, None, r"shared_gate needs a shared expert \(shared_ffn_dim\)"),
        ({"shared_ffn_dim": 0}, None, r"shared_ffn_dim must be a positive int or None, got 0"),
    ],
)
def test_bad_configuration_raises_with_the_arithmetic(kwargs, comm, message):
    args = {"n_experts": 8, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        MoE(DIM, FFN, comm=comm, **args)


def test_wrong_input_width_raises():
    with pytest.raises(ValueError, match=r"MoE: input's last dim 5 != dim\(8\)"):
        MoE(DIM, FFN)(torch.zeros(3, 5))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_expert_bias_steers_the_choice_not_the_weights(router):
    """DeepSeek-V3's auxiliary-loss-free balancing: the top-k chosen by scores + bias, the
    weights the chosen experts' own scores (sigmoid: normalised over the k), against a float64
    loop; a bias pushing one expert up puts it in every token's top-k; the counts accumulate
    in training only, and update_expert_bias moves each bias by the rate toward the mean and
    restarts them."""
    from dist_kernels.moe import update_expert_bias

    print("seed", SEED)
    torch.manual_seed(SEED)
    layer = MoE(DIM, FFN, EXPERTS, 2, router=router, expert_bias=True, bias_update_rate=0.01)
    layer = layer.double()
    r = layer.router
    gen = torch.Generator().manual_seed(SEED + 5)
    with torch.no_grad():
        r.expert_bias.copy_(torch.randn(EXPERTS, generator=gen) * 0.05)
        r.expert_bias[3] = 10.0  # every token's top-k
    x = torch.randn(29, DIM, generator=gen, dtype=torch.float64)
    routing = r(x)
    logits = x @ r.weight.t()
    for t in range(29):
        s = torch.softmax(logits[t], -1) if router == "softmax" else torch.sigmoid(logits[t])
        chosen = torch.topk(s + r.expert_bias.double(), 2).indices
        w = s[chosen] if router == "softmax" else s[chosen] / s[chosen].sum()
        assert routing.experts[t].tolist() == chosen.tolist()
        torch.testing.assert_close(routing.weights[t], w, rtol=0, atol=1e-15)
        assert 3 in chosen.tolist()
    counts = torch.bincount(routing.experts.reshape(-1), minlength=EXPERTS)
    assert torch.equal(r.tokens_per_expert, counts)  # training mode, grad enabled
    with torch.no_grad():
        r(x)
    layer.eval()
    r(x)
    assert torch.equal(r.tokens_per_expert, counts)  # neither counted
    before = r.expert_bias.clone()
    update_expert_bias(layer)
    mean = counts.sum() / EXPERTS
    want = before + 0.01 * torch.sign(mean - counts.double()).float()
    assert torch.equal(r.expert_bias, want) and int(r.tokens_per_expert.sum()) == 0
    assert "expert_bias" in r.state_dict() and "tokens_per_expert" not in r.state_dict()


def _rank_bias_update(seed):
    from dist_kernels.moe import update_expert_bias

    comm = dk.Communicator()
    torch.manual_seed(seed)
    dense = MoE(DIM, FFN, EXPERTS, 2, expert_bias=True).double()
    moe = shard_experts(dense, comm)
    x = _tokens("random", comm.rank, comm.world_size, seed)
    moe(x)
    mine = moe.router.tokens_per_expert.clone()
    update_expert_bias(moe, comm)
    return mine, moe.router.expert_bias.clone()


def test_expert_bias_updates_from_every_ranks_counts():
    """At ep 2 each rank counts its own tokens' choices; the update sums them over the ranks,
    so both ranks move every bias the same way: by the sign of the summed counts' mean minus
    each expert's summed count."""
    results = run_ranks(2, _rank_bias_update, SEED, timeout=300)
    total = results[0][0] + results[1][0]
    assert not torch.equal(results[0][0], results[1][0])  # the ranks saw different tokens
    want = 1e-3 * torch.sign(total.sum() / EXPERTS - total.double()).float()
    for _, bias in results:
        assert torch.equal(bias, want)


def test_expert_bias_balances_a_skewed_router():
    """The balancing itself, with DeepSeek-V3's sigmoid router made to prefer two of the eight
    experts (every token's logits for them raised by 3: max / mean assignments 2.6 at first):
    updated after each batch of fresh tokens, the bias spreads the assignments until the
    busiest expert gets under 1.4x the mean; with the rate 0 nothing changes."""
    from dist_kernels.moe import update_expert_bias

    print("seed", SEED)
    imbalance = {}
    for rate in (0.0, 0.003):
        torch.manual_seed(SEED)
        layer = MoE(DIM, FFN, EXPERTS, 2, router="sigmoid", expert_bias=True,
                    bias_update_rate=rate).double()  # fmt: skip
        with torch.no_grad():  # feature 0 is a constant 1: experts 0 and 1 get +3
            layer.router.weight.normal_(0.0, 1.0)
            layer.router.weight[:, 0] = 0.0
            layer.router.weight[:2, 0] = 3.0
        gen = torch.Generator().manual_seed(SEED + 6)
        history = []
        for _ in range(400):
            x = torch.randn(512, DIM, generator=gen, dtype=torch.float64)
            x[:, 0] = 1.0
            routed = layer.router(x).routed
            history.append(float(routed.max()) / float(routed.float().mean()))
            update_expert_bias(layer)
        imbalance[rate] = history
    print(f"imbalance: {imbalance[0.003][0]:.2f} -> {max(imbalance[0.003][-50:]):.2f}")
    assert imbalance[0.003][0] == imbalance[0.0][0] > 2.2
    assert min(imbalance[0.0]) > 2.2  # no bias update: as skewed as ever
    assert max(imbalance[0.003][-50:]) < 1.4
