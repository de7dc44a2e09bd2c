"""MoE: a mixture-of-experts layer whose experts are sharded over an expert-parallel group.

    moe = MoE(dim, ffn_dim, n_experts=8, top_k=2, comm=mesh.ep_comm)
    y = moe(x)                      # x [tokens, dim] or [..., dim]
    loss = task_loss + moe.aux_loss

Expert e lives on ep rank ``e // (n_experts / ep)``. The dispatch path (torchtitan's
``expert_parallel.py`` and Megatron's ``alltoall`` token dispatcher), per rank:

    1. route        experts, weights [T, k]; capacity drops         (router.py, before any send)
    2. count        assignments per expert, [E]; one all_gather      -> counts [ep, E] everywhere
                    (small: the one-shot path), so every rank knows every split
    3. sort         kept assignments by expert: by destination rank, then by local expert
    4. dispatch     rows x[token] all_to_all'd by rank                 (exchange.py: autograd,
                                                                         backward = reverse)
    5. regroup      received rows [src rank][local expert] -> [local expert][src rank]
    6. experts      one SwiGLU per local expert on its contiguous rows
    7. combine      rows back in [src rank][local expert] order, the reverse all_to_all,
                    y[token] += weight * row                            (router grads via weight)

On one host's shared memory (``push.py``) steps 4 + 5 are one write per row: the sender
gathers ``x[token]`` straight into the receiver's memory, already grouped by local expert, and
step 7 writes each expert output straight back into its source rank's memory. Elsewhere (a
communicator without ``empty_symmetric``) 4 and 7 are all-to-alls (``exchange.py``) and 5 a
local permutation.

With ``comm`` None (or of one rank) every expert is local and steps 2, 4 and 7 move nothing:
the unsharded layer, the reference the sharded one must equal.

A shared expert (``shared_ffn_dim``: DeepSeek's, Qwen2-MoE's, Megatron's
``--moe-shared-expert-intermediate-size``) is one more SwiGLU that every token passes through,
beside the routed ones, its output added to theirs; with ``shared_gate`` it is first scaled by
``sigmoid(x . g)`` (Qwen2-MoE's ``shared_expert_gate``). It is dense: the same on every ep
rank, not ``expert_parallel``, reduced over all of dp as the attention is.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .exchange import exchange_rows
from .push import RowPlan, push_rows, supports_push
from .router import Router, Routing

__all__ = ["Expert", "MoE", "shard_experts"]


class Expert(nn.Module):
    """SwiGLU feed-forward (Mixtral's expert): ``w2(silu(w1 x) * w3 x)``, no biases."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _ep_size(comm: Any) -> int:
    return 1 if comm is None else comm.world_size


def _check_shared(shared_ffn_dim: Optional[int], shared_gate: bool, comm: Any) -> None:
    who = f"[rank {0 if comm is None else comm.rank}] MoE"
    if shared_ffn_dim is not None and (
        not isinstance(shared_ffn_dim, int)
        or isinstance(shared_ffn_dim, bool)
        or shared_ffn_dim < 1
    ):
        raise ValueError(
            f"{who}: shared_ffn_dim must be a positive int or None, got {shared_ffn_dim!r}"
        )
    if shared_gate and not shared_ffn_dim:
        raise ValueError(f"{who}: shared_gate needs a shared expert (shared_ffn_dim)")


def _check_config(dim: int, ffn_dim: int, n_experts: int, top_k: int, comm: Any) -> None:
    rank = 0 if comm is None else comm.rank
    for name, value in (("dim", dim), ("ffn_dim", ffn_dim), ("n_experts", n_experts)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"[rank {rank}] MoE: {name} must be a positive int, got {value!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(
            f"[rank {rank}] MoE: top_k({top_k}) must be in [1, n_experts({n_experts})]"
        )
    ep = _ep_size(comm)
    if n_experts % ep:
        raise ValueError(
            f"[rank {rank}] MoE: n_experts({n_experts}) % ep({ep}) = {n_experts % ep}: every "
            f"ep rank holds n_experts / ep experts"
        )
    if getattr(comm, "num_hosts", 1) > 1:
        raise ValueError(
            f"[rank {rank}] MoE: the ep group spans {comm.num_hosts} hosts ({ep} ranks): the "
            "token all-to-all runs every layer and must stay on one host's shared memory; "
            "put ep inside a host (ProcessMesh keeps ep groups on consecutive ranks)"
        )


class MoE(nn.Module):
    """Router + experts; see the module docstring. When sharded (an ep group of more than
    one rank) the expert parameters carry ``expert_parallel = True``: engines must reduce them
    over the expert's replicas only (``dk.DDP(..., expert_comm=mesh.expert_dp_comm)``)."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        n_experts: int = 8,
        top_k: int = 2,
        comm: Any = None,
        capacity_factor: Optional[float] = None,
        router: str = "softmax",
        aux_loss_coeff: float = 1e-2,
        z_loss_coeff: float = 0.0,
        drop_policy: str = "probs",
        norm_topk: bool = False,
        shared_ffn_dim: Optional[int] = None,
        shared_gate: bool = False,
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        _check_config(dim, ffn_dim, n_experts, top_k, comm)
        _check_shared(shared_ffn_dim, shared_gate, comm)
        self.dim, self.ffn_dim, self.n_experts, self.top_k = dim, ffn_dim, n_experts, top_k
        self.comm = None if _ep_size(comm) == 1 else comm
        self.router = Router(
            dim,
            n_experts,
            top_k,
            router,
            capacity_factor,
            drop_policy,
            aux_loss_coeff,
            z_loss_coeff,
            norm_topk,
            expert_bias,
            bias_update_rate,
        )
        ep, rank = _ep_size(comm), 0 if comm is None else comm.rank
        self.num_local = n_experts // ep
        self.local_expert_ids = list(range(rank * self.num_local, (rank + 1) * self.num_local))
        self.experts = nn.ModuleList(Expert(dim, ffn_dim) for _ in self.local_expert_ids)
        self.shared_expert = Expert(dim, shared_ffn_dim) if shared_ffn_dim else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self._mark_experts()
        self.aux_loss: Optional[torch.Tensor] = None
        self.last_stats: Dict[str, Any] = {}

    def _mark_experts(self) -> None:
        """Sharded experts differ across ep ranks: tag them for the engines."""
        if self.comm is not None:
            for p in self.experts.parameters():
                p.expert_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.dim:
            raise ValueError(f"{self._who()}: input's last dim {shape[-1]} != dim({self.dim})")
        tokens = x.reshape(-1, self.dim)
        routing = self.router(tokens)
        self.aux_loss = routing.aux_loss
        y = self._dispatch_and_combine(tokens, routing)
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            y = y + shared
        return y.reshape(shape)

    def _who(self) -> str:
        return f"[rank {0 if self.comm is None else self.comm.rank}] MoE"

    # Eager under torch.compile (a graph break before and after): the token counts decide
    # every shape from here on, and the exchange writes into shared-memory slabs that dynamo
    # cannot trace (it raised at the first compiled forward); the router before it compiles.
    @torch.compiler.disable
    def _dispatch_and_combine(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        flat_e = r.experts.reshape(-1)
        kept = torch.nonzero(r.keep.reshape(-1)).squeeze(1)
        order = kept[torch.sort(flat_e[kept], stable=True).indices]  # 3. by expert
        token = order // self.top_k
        local_counts = torch.bincount(flat_e[order], minlength=self.n_experts)
        counts = self._count_exchange(local_counts, r.routed)  # 2. [ep, E]
        if supports_push(self.comm):  # 4. + 5. in one write per row, 7. likewise
            push = RowPlan.moe_dispatch(counts.tolist(), self.num_local)
            rows = push_rows(x, token, self.comm, push)
            per_expert = counts[:, self.local_expert_ids].sum(0).tolist()
            out = self._run_experts(rows, per_expert)  # 6.
            back = push_rows(out, None, self.comm, push.transposed())
        else:
            plan = _ExchangePlan(counts, self.num_local, 0 if self.comm is None else self.comm.rank)
            rows = self._to_experts(x, token, plan)  # 4. + 5.
            out = self._run_experts(rows, plan.rows_per_local_expert)  # 6.
            back = self._from_experts(out, plan)  # 7.
        w = r.weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add(0, token, back * w)

    def _count_exchange(self, kept: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """Kept assignments per expert of every ep rank, [ep, E]; records last_stats."""
        mine = torch.stack([kept, routed]).to(torch.int64)
        if self.comm is None:
            gathered = mine.unsqueeze(0)
        else:
            gathered = mine.new_empty(self.comm.world_size, *mine.shape)
            self.comm.all_gather(gathered.view(-1), mine.view(-1))
        self._record_stats(gathered[:, 0], gathered[:, 1])
        return gathered[:, 0]

    def _record_stats(self, kept: torch.Tensor, routed: torch.Tensor) -> None:
        per_expert = kept.sum(0)
        total = int(routed.sum())
        mean = float(per_expert.sum()) / self.n_experts
        self.last_stats = {
            "tokens_per_expert": per_expert.tolist(),
            "dropped": total - int(per_expert.sum()),
            "drop_rate": (total - int(per_expert.sum())) / total if total else 0.0,
            "imbalance": float(per_expert.max()) / mean if mean else 0.0,
        }

    def _to_experts(self, x: torch.Tensor, token: torch.Tensor, plan: _ExchangePlan):
        if self.comm is None:
            return x.index_select(0, token)
        arrived = exchange_rows(x, token, self.comm, plan.sends, plan.recvs, plan.buffer_rows)
        return arrived.index_select(0, plan.regroup)

    def _from_experts(self, out: torch.Tensor, plan: _ExchangePlan) -> torch.Tensor:
        if self.comm is None:
            return out
        return exchange_rows(out, plan.ungroup, self.comm, plan.recvs, plan.sends, plan.buffer_rows)

    def _run_experts(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        chunks = rows.split(list(counts))
        outs = [expert(chunk) for expert, chunk in zip(self.experts, chunks)]
        return torch.cat(outs) if outs else rows

    def extra_repr(self) -> str:
        sizes = f"dim={self.dim}, ffn_dim={self.ffn_dim}, n_experts={self.n_experts}"
        shared = (
            "" if self.shared_expert is None else f", shared={self.shared_expert.w1.out_features}"
        )
        return f"{sizes}, top_k={self.top_k}, ep={_ep_size(self.comm)}{shared}"


class _ExchangePlan:
    """Splits and permutations of one step from the count matrix ``counts`` [ep, E]: pure
    arithmetic, the same on every rank (each rank reads its own row and column block).

        counts[src, e]: rows rank src sends to expert e
        sends[p]   = sum_e in experts of p  counts[me, e]
        recvs[src] = sum_e in my experts    counts[src, e]
        arrived rows: [src 0: le 0, le 1, ...][src 1: le 0, ...] -> regroup: [le 0: src 0, src 1
        ...][le 1: ...]; ungroup is its inverse (back to arrival order for the return trip)
    """

    def __init__(self, counts: torch.Tensor, num_local: int, rank: int) -> None:
        ep = counts.shape[0]
        per_rank = counts.view(ep, ep, num_local)  # [src, dst, local expert]
        mine = per_rank[:, rank]  # [src, local expert]: what arrives here
        self.sends: List[int] = per_rank[rank].sum(1).tolist()
        self.recvs: List[int] = mine.sum(1).tolist()
        self.rows_per_local_expert: List[int] = mine.sum(0).tolist()
        self.buffer_rows = int(max(per_rank.sum(2).sum(1).max(), per_rank.sum(2).sum(0).max()))
        starts = (torch.cumsum(mine.reshape(-1), 0) - mine.reshape(-1)).view_as(mine)
        self.regroup = torch.cat(
            [
                torch.arange(int(starts[s, e]), int(starts[s, e] + mine[s, e]))
                for e in range(num_local)
                for s in range(ep)
            ]
            or [torch.zeros(0, dtype=torch.int64)]
        )
        self.ungroup = torch.empty_like(self.regroup)
        self.ungroup[self.regroup] = torch.arange(self.regroup.numel())


def aux_loss_of(module: nn.Module) -> Optional[torch.Tensor]:
    """The summed load-balancing (and z-) losses of the :class:`MoE` layers inside ``module``
    from their last forward; None when it holds no MoE layer that ran. A pipeline stage's part
    of the aux loss: ``dk.Pipeline(..., stage_loss=dk.moe.aux_loss_of)``."""
    losses = [m.aux_loss for m in module.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def shard_experts(dense: MoE, comm: Any) -> MoE:
    """This rank's share of the unsharded layer ``dense``: the router and experts
    ``[rank * E / ep, (rank + 1) * E / ep)`` copied (same parameter order)."""
    if dense.comm is not None:
        raise ValueError(f"{dense._who()}: shard_experts needs the unsharded layer (comm=None)")
    r = dense.router
    moe = MoE(
        dense.dim,
        dense.ffn_dim,
        dense.n_experts,
        dense.top_k,
        comm,
        r.capacity_factor,
        r.kind,
        r.aux_loss_coeff,
        r.z_loss_coeff,
        r.drop_policy,
        r.norm_topk,
        None if dense.shared_expert is None else dense.shared_expert.w1.out_features,
        dense.shared_expert_gate is not None,
        r.expert_bias is not None,
        r.bias_update_rate,
    ).to(r.weight.device, r.weight.dtype)
    moe.router.load_state_dict(r.state_dict())
    moe.experts = nn.ModuleList(copy.deepcopy(dense.experts[e]) for e in moe.local_expert_ids)
    moe.shared_expert = copy.deepcopy(dense.shared_expert)  # dense: the same on every ep rank
    moe.shared_expert_gate = copy.deepcopy(dense.shared_expert_gate)
    moe._mark_experts()
    return moe
