"""Muon for data-, tensor-, pipeline- and expert-parallel models, with AdamW for the rest.

    groups = dk.optim.muon_param_groups(model, weight_decay=0.1)
    opt = dk.optim.Muon(groups, lr=3e-4, adjust_lr_fn="match_rms_adamw",
                        comm=mesh.dp_cp_comm, tp_comm=mesh.tp_comm, expert_comm=mesh.expert_dp_comm)

Muon (Keller Jordan, 2024; "Muon is Scalable for LLM Training", Moonshot 2025) replaces a hidden
matrix's update by the orthogonalised momentum: ``O = NS(nesterov(momentum))``, where ``NS`` is a
few quintic Newton-Schulz iterations, run in BF16. Its math here is ``torch.optim.Muon``'s, step
for step, so one process gives torch's result bit for bit (tested). Embeddings, the output head,
biases and norms are stepped by AdamW (``torch.optim.adamw``'s functional step, torch's
result bit for bit as well): param groups with ``use_muon=False``, which
:func:`muon_param_groups` builds from a model.

What a process group changes. ``NS`` needs the *whole* matrix, and it costs ``O(m n min(m,n))``
per matrix against AdamW's ``O(m n)``, so running it on every data-parallel replica repeats
the most expensive part of the step ``dp`` times. Here:

1. every replica updates every momentum buffer (element-wise, cheap; the state stays
   replicated, so checkpoints and resumes are the same as for AdamW);
2. the Muon matrices are dealt to the replicas of ``comm`` (whole matrices, the largest first,
   each to the least-loaded rank, as Megatron's layer-wise distributed optimizer deals layers):
   a rank orthogonalises only its own;
3. one ``all_gather`` over ``comm`` hands every rank every orthogonalised update, in
   ``ns_dtype`` (BF16: half the bytes of FP32, and exact, since NS's result is BF16);
4. every rank applies every update: the parameters stay equal on all replicas.

Tensor parallelism (``tp_comm``): a parameter marked ``tensor_parallel_shard`` holds 1/tp of a
matrix along ``tensor_parallel_dim``. With ``tp_mode="duplicated"`` (default) the owning rank's
tp group all-gathers the momentum update into the whole matrix, every tp rank runs NS on it
and keeps its own slice: the result equals tp = 1 (Newton-Schulz commutes with the row
permutation a fused layer's tp layout makes). ``tp_mode="blockwise"`` orthogonalises each shard
by itself (no communication, another optimiser: Megatron's default mode).

ZeRO-1 (``shard_state=True``): step 1 keeps only the matrices dealt to this rank, and AdamW's
parameters are dealt too (by size), each stepped by one replica and all-gathered after the
step: state divided by whole parameters (Megatron-Core's layer-wise distributed optimizer),
results equal to replicated state bit for bit. ``consolidate_state_dict()`` (collective) before
``state_dict()``; ``load_state_dict`` takes a whole state and keeps this rank's part.

Expert parallelism (``expert_comm``): expert weights (``expert_parallel``) differ across the ep
ranks; they are dealt over their own replicas, ``expert_comm``. A model with expert shards and
no ``expert_comm`` raises rather than mixing experts of different ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.optim.adamw import adamw as _adamw_step

from .exchange import as_comm, gather_along, share, size_rank

__all__ = ["Muon", "muon_param_groups", "newton_schulz", "adjusted_lr", "deal_matrices"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
TP_MODES = ("duplicated", "blockwise")
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def newton_schulz(
    update: torch.Tensor,
    coefficients: Tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of a matrix (``U S' V^T`` with ``S'`` near
    the identity), computed in ``dtype`` on the wide orientation (so the Gram matrix is the
    small one); the operation order is torch.optim.Muon's, so BF16 results agree bit for bit."""
    if update.dim() != 2:
        raise ValueError(f"newton_schulz: expected a matrix, got shape {tuple(update.shape)}")
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.to(dtype)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1: inside NS's basin
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """The learning rate one matrix of ``shape`` is stepped with. ``original`` (None): Keller
    Jordan's ``sqrt(max(1, rows / cols))``; ``match_rms_adamw``: Moonshot's
    ``0.2 sqrt(max(rows, cols))``, which gives the update AdamW's RMS, so AdamW's learning rate
    and weight decay carry over."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def deal_matrices(shapes: Sequence[Sequence[int]], world_size: int) -> List[int]:
    """The rank of ``world_size`` that orthogonalises each matrix: the costliest first, each to
    the rank with the least work so far (the lowest on ties). Pure and deterministic, so every
    rank computes the same deal from the shapes alone."""
    cost = [r * c * min(r, c) for r, c in shapes]  # Newton-Schulz's multiply-adds, up to a constant
    load, owner = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += cost[i]
    return owner


def muon_param_groups(
    model: nn.Module, weight_decay: float = 0.1, adamw_weight_decay: Optional[float] = None
) -> List[Dict[str, Any]]:
    """Param groups for :class:`Muon`: the hidden matrices (2-D weights of modules that are not
    embeddings, and not the output head, a module named ``lm_head`` or ``output``) with
    Muon; embeddings and the head with AdamW and weight decay; biases, norms and other
    1-D parameters with AdamW and none. ``adamw_weight_decay``: the AdamW matrices' decay
    (default ``weight_decay``). A module with a ``fused_qkv()`` method (the GPT's attention)
    has its fused projection's layout noted on the weight (``muon_qkv``) for ``split_qkv``."""
    muon, adamw_decay, adamw_flat, seen = [], [], [], set()
    for module in model.modules():  # fused projections: their layout, for split_qkv
        if callable(getattr(module, "fused_qkv", None)):
            weight, per_group, head_dim = module.fused_qkv()
            weight.muon_qkv = (per_group, head_dim)
    for module_name, module in model.named_modules():
        head = module_name.rsplit(".", 1)[-1] in ("lm_head", "output")
        for p in module.parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if p.dim() < 2:
                adamw_flat.append(p)
            elif p.dim() == 2 and not head and not _is_embedding(module):
                muon.append(p)
            else:
                adamw_decay.append(p)
    decay = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    groups = [
        {"params": muon, "use_muon": True, "weight_decay": weight_decay},
        {"params": adamw_decay, "use_muon": False, "weight_decay": decay},
        {"params": adamw_flat, "use_muon": False, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _is_embedding(module: nn.Module) -> bool:
    """``nn.Embedding`` and the embedding layers named so (``VocabParallelEmbedding``), told by
    name: the optimizers import no layer above them."""
    return isinstance(module, nn.Embedding) or type(module).__name__.endswith("Embedding")


class Muon(torch.optim.Optimizer):
    """Muon for ``use_muon`` param groups (the default), AdamW for the others.

    Args:
        params: parameters or param groups; a group with ``use_muon=False`` is stepped by
            AdamW with its ``betas`` and ``eps`` (defaults ``adamw_betas``, ``adamw_eps``).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon`` (``eps`` is Newton-Schulz's; AdamW groups have their own).
        adamw_betas, adamw_eps: the AdamW groups' defaults.
        comm: the replicas of the parameters (same values, same reduced gradients: the
            data-parallel group, dp x cp); Newton-Schulz is dealt over it. None: one replica.
            A dist_kernels Communicator, or a ``torch.distributed`` process group (a torch
            DDP script's ``dist.group.WORLD``); so are ``tp_comm`` and ``expert_comm``.
        tp_comm: the tensor-parallel group joining ``tensor_parallel_shard`` parameters.
        expert_comm: the replicas of expert-parallel parameters (``mesh.expert_dp_comm``).
        tp_mode: ``duplicated`` (whole matrices, equal to tp = 1) or ``blockwise``.
        ns_dtype: Newton-Schulz's precision (BF16 as torch; float64 for exact comparisons).
        split_qkv: a fused query / key / value weight (``muon_qkv``, set by
            :func:`muon_param_groups`) orthogonalised as its three matrices, each stepped with
            its own shape's rate (Megatron-Core's ``--muon-split-qkv``); the result is that of
            ``torch.optim.Muon`` on separate projections.
        shard_state: ZeRO-1 by whole parameters (Megatron-Core's layer-wise distributed
            optimizer): each replica keeps the state of, and steps, only the parameters dealt
            to it (Muon's matrices and AdamW's parameters alike), and the replicas exchange
            the results; a checkpoint calls :meth:`consolidate_state_dict` on every replica
            before :meth:`state_dict`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
        *,
        adamw_betas: Tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        comm: Any = None,
        tp_comm: Any = None,
        expert_comm: Any = None,
        tp_mode: str = "duplicated",
        ns_dtype: torch.dtype = torch.bfloat16,
        shard_state: bool = False,
        split_qkv: bool = False,
    ) -> None:
        _check_args(lr, weight_decay, momentum, ns_steps, adjust_lr_fn, tp_mode)
        groups = list(params)
        if groups and isinstance(groups[0], dict):  # AdamW groups take AdamW's defaults
            groups = [_adamw_defaults(g, adamw_betas, adamw_eps) for g in groups]
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            use_muon=True,
        )
        super().__init__(groups, defaults)
        self.comm, self.tp_comm, self.expert_comm = map(as_comm, (comm, tp_comm, expert_comm))
        self.tp_mode, self.ns_dtype = tp_mode, ns_dtype
        self.shard_state, self.split_qkv = bool(shard_state), bool(split_qkv)
        self.last_orthogonalized = 0  # matrices this rank ran Newton-Schulz on in the last step
        self._consolidated = False  # consolidate_state_dict() ran since the last step
        for group in self.param_groups:
            _check_param_group(group)
        self._owner = self._deal()

    def _deal(self) -> Dict[int, int]:
        """``id(param) -> rank of its replicas`` that steps it: Muon matrices by Newton-Schulz
        cost, and with ``shard_state`` AdamW's parameters by size. Fixed at construction
        (the parameters' order and shapes are every replica's), so the state a rank holds
        does not move."""
        owner: Dict[int, int] = {}
        for use_muon in (True, False):
            kind = [p for g in self.param_groups if g["use_muon"] == use_muon for p in g["params"]]
            for comm, params in self._by_replicas(kind):
                size, own = size_rank(comm)
                shapes = [self._ns_shape(p) if use_muon else (p.numel(), 1) for p in params]
                if not use_muon and not self.shard_state:  # every replica steps AdamW's
                    owner.update((id(p), own) for p in params)
                    continue
                for p, rank in zip(params, deal_matrices(shapes, size)):
                    owner[id(p)] = rank
        return owner

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_owner"):  # after construction: deal again, with the new group
            _check_param_group(self.param_groups[-1])
            self._owner = self._deal()

    def _owns(self, p: torch.Tensor) -> bool:
        """Whether this rank steps ``p`` (without ``shard_state`` every replica steps
        AdamW's parameters; Muon's matrices are always dealt)."""
        return self._owner[id(p)] == size_rank(self._replicas(p))[1]

    # -- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._consolidated = False
        matrices: List[Tuple[torch.Tensor, Dict[str, Any]]] = []
        flat: List[Tuple[torch.Tensor, Dict[str, Any]]] = []
        for group in self.param_groups:
            for p in _with_grad(group):
                (matrices if group["use_muon"] else flat).append((p, group))
        # the momentum: every replica's copy, or (shard_state) the owner's only
        for p, group in matrices:
            if not self.shard_state or self._owns(p):
                self._momentum(p, group)
        self._adamw([(p, group) for p, group in flat if self._owns(p)])
        updates = self._orthogonalize_all(matrices)
        for (p, group), update in zip(matrices, updates):
            lr = group["lr"]
            p.mul_(1 - lr * group["weight_decay"])
            for part, shape in self._parts(p, p.detach(), update):  # the whole, or q, k, v
                target, value = part
                rate = adjusted_lr(lr, group["adjust_lr_fn"], shape)
                target.add_(value.view_as(target), alpha=-rate)
        if self.shard_state:
            self._share_stepped([p for p, _ in flat])
        return loss

    def _share_stepped(self, params: List[torch.Tensor]) -> None:
        """``shard_state``: AdamW's parameters, from the replicas that stepped them."""
        for comm, group in self._by_replicas(params):
            if size_rank(comm)[0] == 1:
                continue
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = defaultdict(list)
            for p in group:
                by_dtype[p.dtype].append(p)
            for dtype, same in by_dtype.items():
                owners = [self._owner[id(p)] for p in same]
                values: List[Optional[torch.Tensor]] = [p.detach() for p in same]
                share(comm, values, owners, dtype)
                for p, value, o in zip(same, values, owners):
                    if o != comm.rank:
                        p.copy_(value)

    def _momentum(self, p: torch.Tensor, group: Dict[str, Any]) -> None:
        """Updates ``p``'s momentum buffer."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        state["momentum_buffer"].lerp_(p.grad, 1 - group["momentum"])

    def _update(self, p: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
        """What Newton-Schulz orthogonalises: the Nesterov look-ahead or the buffer itself
        (computed by the matrix's owner only)."""
        buf = self.state[p]["momentum_buffer"]
        return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _by_replicas(self, params: List[torch.Tensor]):
        """``[(replicas, their parameters in order)]``, one entry per communicator (None:
        one replica)."""
        by_comm: Dict[int, List[torch.Tensor]] = defaultdict(list)
        comms: Dict[int, Any] = {}
        for p in params:
            comm = self._replicas(p)
            comms[id(comm)] = comm
            by_comm[id(comm)].append(p)
        return [(comms[key], ps) for key, ps in by_comm.items()]

    def _orthogonalize_all(self, matrices) -> List[torch.Tensor]:
        """Every matrix's orthogonalised update in its parameter's (shard's) shape: each
        computed by the replica it is dealt to, then exchanged."""
        group_of = {id(p): g for p, g in matrices}
        done: Dict[int, torch.Tensor] = {}
        self.last_orthogonalized = 0
        for comm, params in self._by_replicas([p for p, _ in matrices]):
            for p in params:
                if self._owns(p):
                    group = group_of[id(p)]
                    done[id(p)] = self._orthogonalize(p, group, self._update(p, group))
                    self.last_orthogonalized += 1
            if size_rank(comm)[0] > 1:
                owners = [self._owner[id(p)] for p in params]
                values = [done.get(id(p)) for p in params]
                share(comm, values, owners, self.ns_dtype, shapes=[p.shape for p in params])
                done.update({id(p): v for p, v in zip(params, values)})
        return [done[id(p)] for p, _ in matrices]

    def _orthogonalize(self, p: torch.Tensor, group: Dict[str, Any], update: torch.Tensor):
        if not self._joined(p):
            return self._newton_schulz(p, group, update)
        dim = p.tensor_parallel_dim
        whole = gather_along(self.tp_comm, update, dim)
        ortho = self._newton_schulz(p, group, whole)
        size = p.shape[dim]  # every tp rank ran the same NS and keeps its own slice
        return ortho.narrow(dim, self.tp_comm.rank * size, size).contiguous()

    def _newton_schulz(self, p: torch.Tensor, group: Dict[str, Any], matrix: torch.Tensor):
        """NS of ``matrix`` (``p``'s update, whole or this shard's), or of its q, k and v."""
        coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
        if not self._split(p):
            return newton_schulz(matrix, coefficients, steps, eps, self.ns_dtype)
        out = torch.empty(matrix.shape, dtype=self.ns_dtype)
        for (target, value), _ in self._parts(p, out, matrix):
            target.copy_(
                newton_schulz(value, coefficients, steps, eps, self.ns_dtype).view_as(target)
            )
        return out

    def _split(self, p: torch.Tensor) -> bool:
        return self.split_qkv and hasattr(p, "muon_qkv")

    def _parts(self, p: torch.Tensor, target: torch.Tensor, value: torch.Tensor):
        """``[((target part, value part), the part's NS shape)]``: the whole matrix, or with
        ``split_qkv`` its query, key and value rows (``[group][q_1 .. q_r, k, v][head_dim]``;
        the value parts as matrices, the target parts as views to write into)."""
        shape = self._ns_shape(p)
        if not self._split(p):
            return [((target, value), shape)]
        r, d = p.muon_qkv
        rows, cols = target.shape
        groups, whole_groups = rows // ((r + 2) * d), shape[0] // ((r + 2) * d)
        t = target.view(groups, r + 2, d, cols)
        v = value.view(groups, r + 2, d, cols)
        return [
            ((t[:, :r], v[:, :r].reshape(-1, cols)), (whole_groups * r * d, cols)),
            ((t[:, r], v[:, r].reshape(-1, cols)), (whole_groups * d, cols)),
            ((t[:, r + 1], v[:, r + 1].reshape(-1, cols)), (whole_groups * d, cols)),
        ]

    # -- state sharded over the replicas ------------------------------------------------------

    def consolidate_state_dict(self) -> None:
        """With ``shard_state``: every replica receives every parameter's state from the rank
        that holds it, so that :meth:`state_dict` (on any replica) returns the whole state.
        Collective over the replicas (as torch's ``ZeroRedundancyOptimizer.consolidate_state_dict``,
        which gathers to one rank); the copies are dropped by the next step."""
        if not self.shard_state:
            return
        for group in self.param_groups:
            for comm, params in self._by_replicas(list(group["params"])):
                if size_rank(comm)[0] > 1:
                    for p in params:
                        self._broadcast_state(comm, p, group)
        self._consolidated = True

    def _broadcast_state(self, comm: Any, p: torch.Tensor, group: Dict[str, Any]) -> None:
        owner, rank = self._owner[id(p)], size_rank(comm)[1]
        present = torch.tensor([1 if self.state.get(p) else 0], dtype=torch.int32)
        comm.broadcast(present, src=owner)
        if not present.item():
            return  # never stepped: no state anywhere
        state = self.state[p]
        if rank != owner and not state:
            like = torch.zeros_like(p)
            if group["use_muon"]:
                state["momentum_buffer"] = like
            else:
                state.update(step=torch.tensor(0.0), exp_avg=like, exp_avg_sq=like.clone())
        for key in sorted(state):
            comm.broadcast(state[key], src=owner)

    def state_dict(self) -> Dict[str, Any]:
        if self.shard_state and size_rank(self.comm)[0] > 1 and not self._consolidated:
            raise RuntimeError(
                f"Muon (rank {size_rank(self.comm)[1]}): state_dict() with shard_state "
                "needs consolidate_state_dict() on every replica first (each holds its part)"
            )
        return super().state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a whole state (any replica's consolidated one, or an unsharded run's); with
        ``shard_state`` each rank then keeps its own parameters' state only."""
        super().load_state_dict(state_dict)
        self._drop_others()

    def _drop_others(self) -> None:
        if not self.shard_state:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if not self._owns(p):
                    self.state.pop(p, None)

    def _replicas(self, p: torch.Tensor) -> Any:
        if not getattr(p, "expert_parallel", False):
            return self.comm
        if self.expert_comm is None and size_rank(self.comm)[0] > 1:
            raise ValueError(
                f"Muon (rank {size_rank(self.comm)[1]}): a parameter of shape "
                f"{tuple(p.shape)} is an expert shard (expert_parallel) and expert_comm is "
                "None: its replicas are the expert-data-parallel group (mesh.expert_dp_comm)"
            )
        return self.expert_comm

    def _joined(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s update is orthogonalised as the whole tp-joined matrix."""
        return (
            self.tp_mode == "duplicated"
            and getattr(p, "tensor_parallel_shard", False)
            and self.tp_comm is not None
            and self.tp_comm.world_size > 1
        )

    def _ns_shape(self, p: torch.Tensor) -> Tuple[int, int]:
        """The shape Newton-Schulz sees: the whole matrix when tp shards are joined."""
        shape = list(p.shape)
        if self._joined(p):
            shape[p.tensor_parallel_dim] *= self.tp_comm.world_size
        return tuple(shape)

    def _adamw(self, items: List[Tuple[torch.Tensor, Dict[str, Any]]]) -> None:
        """torch.optim.AdamW's step for ``items`` (its functional form: the same result),
        one call per param group."""
        by_group: Dict[int, List[torch.Tensor]] = defaultdict(list)
        groups: Dict[int, Dict[str, Any]] = {}
        for p, group in items:
            by_group[id(group)].append(p)
            groups[id(group)] = group
        for key, params in by_group.items():
            self._adamw_group(groups[key], params)

    def _adamw_group(self, group: Dict[str, Any], params: List[torch.Tensor]) -> None:
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        _adamw_step(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _with_grad(group: Dict[str, Any]) -> List[torch.Tensor]:
    return [p for p in group["params"] if p.grad is not None]


def _adamw_defaults(group: Dict[str, Any], betas, eps) -> Dict[str, Any]:
    if group.get("use_muon", True):
        return group
    return {"betas": tuple(betas), "eps": eps, **group}


def _check_args(lr, weight_decay, momentum, ns_steps, adjust_lr_fn, tp_mode) -> None:
    if lr < 0.0:
        raise ValueError(f"Muon: lr must be >= 0, got {lr}")
    if weight_decay < 0.0:
        raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
    if not 0 < ns_steps < 100:
        raise ValueError(f"Muon: ns_steps must be in [1, 99], got {ns_steps}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Muon: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    if tp_mode not in TP_MODES:
        raise ValueError(f"Muon: tp_mode must be one of {TP_MODES}, got {tp_mode!r}")


def _check_param_group(group: Dict[str, Any]) -> None:
    for p in group["params"]:
        _check_param(p, group)


def _check_param(p: torch.Tensor, group: Dict[str, Any]) -> None:
    if p.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"Muon: floating-point parameters only, got {p.dtype}")
    if group["use_muon"] and p.dim() != 2:
        raise ValueError(
            f"Muon: a use_muon group holds a parameter of shape {tuple(p.shape)}; Muon steps "
            "matrices only (put it in a use_muon=False group: dk.optim.muon_param_groups)"
        )
