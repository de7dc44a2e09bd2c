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
    (default ``weight_decay``)."""
    muon, adamw_decay, adamw_flat, seen = [], [], [], set()
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
        tp_comm: the tensor-parallel group joining ``tensor_parallel_shard`` parameters.
        expert_comm: the replicas of expert-parallel parameters (``mesh.expert_dp_comm``).
        tp_mode: ``duplicated`` (whole matrices, equal to tp = 1) or ``blockwise``.
        ns_dtype: Newton-Schulz's precision (BF16 as torch; float64 for exact comparisons).
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
        self.comm, self.tp_comm, self.expert_comm = comm, tp_comm, expert_comm
        self.tp_mode, self.ns_dtype = tp_mode, ns_dtype
        self.last_orthogonalized = 0  # matrices this rank ran Newton-Schulz on in the last step
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p, group)

    # -- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices: List[Tuple[torch.Tensor, Dict[str, Any]]] = []
        for group in self.param_groups:
            if group["use_muon"]:
                for p in _with_grad(group):
                    self._momentum(p, group)  # every replica: the state stays replicated
                    matrices.append((p, group))
            else:
                self._adamw(group)
        updates = self._orthogonalize_all(matrices)
        for (p, group), update in zip(matrices, updates):
            lr = group["lr"]
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], self._ns_shape(p)))
        return loss

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

    def _orthogonalize_all(self, matrices) -> List[torch.Tensor]:
        """Every matrix's orthogonalised update in its parameter's (shard's) shape: each
        computed by the replica it is dealt to, then exchanged."""
        updates: List[Optional[torch.Tensor]] = [None] * len(matrices)
        by_replicas: Dict[int, List[int]] = defaultdict(list)
        replicas: Dict[int, Any] = {}
        for i, (p, _) in enumerate(matrices):
            comm = self._replicas(p)
            replicas[id(comm)] = comm
            by_replicas[id(comm)].append(i)
        self.last_orthogonalized = 0
        for key, indices in by_replicas.items():
            comm = replicas[key]
            size, rank = _size_rank(comm)
            owner = deal_matrices([self._ns_shape(matrices[i][0]) for i in indices], size)
            mine = [i for i, o in zip(indices, owner) if o == rank]
            for i in mine:
                p, group = matrices[i]
                updates[i] = self._orthogonalize(p, group, self._update(p, group))
            self.last_orthogonalized += len(mine)
            if size > 1:
                self._exchange(comm, [matrices[i][0] for i in indices], owner, updates, indices)
        return updates  # type: ignore[return-value]

    def _orthogonalize(self, p: torch.Tensor, group: Dict[str, Any], update: torch.Tensor):
        coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
        if not self._joined(p):
            return newton_schulz(update, coefficients, steps, eps, self.ns_dtype)
        dim = p.tensor_parallel_dim
        whole = _gather_along(self.tp_comm, update, dim)
        ortho = newton_schulz(whole, coefficients, steps, eps, self.ns_dtype)
        size = p.shape[dim]  # every tp rank ran the same NS and keeps its own slice
        return ortho.narrow(dim, self.tp_comm.rank * size, size).contiguous()

    def _exchange(self, comm, params, owner, updates, indices) -> None:
        """One all_gather over ``comm``: rank r's orthogonalised matrices, in deal order, padded
        to the largest rank's total; every rank unpacks every rank's."""
        size, rank = _size_rank(comm)
        numel = [0] * size
        for p, o in zip(params, owner):
            numel[o] += p.numel()
        width = max(numel)
        send = torch.zeros(width, dtype=self.ns_dtype)
        offset = 0
        for i, o in zip(indices, owner):
            if o == rank:
                n = updates[i].numel()
                send[offset : offset + n].copy_(updates[i].reshape(-1))
                offset += n
        received = torch.empty(size * width, dtype=self.ns_dtype)
        comm.all_gather(received, send)
        offsets = [r * width for r in range(size)]
        for p, i, o in zip(params, indices, owner):
            if o != rank:
                updates[i] = received[offsets[o] : offsets[o] + p.numel()].view(p.shape)
            offsets[o] += p.numel()

    def _replicas(self, p: torch.Tensor) -> Any:
        if not getattr(p, "expert_parallel", False):
            return self.comm
        if self.expert_comm is None and _size_rank(self.comm)[0] > 1:
            raise ValueError(
                f"Muon (rank {_size_rank(self.comm)[1]}): a parameter of shape "
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

    def _adamw(self, group: Dict[str, Any]) -> None:
        """torch.optim.AdamW's step for one group (its functional form: the same result)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in _with_grad(group):
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
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


def _size_rank(comm: Any) -> Tuple[int, int]:
    return (1, 0) if comm is None else (comm.world_size, comm.rank)


def _gather_along(comm: Any, shard: torch.Tensor, dim: int) -> torch.Tensor:
    """The tp group's shards of a matrix joined along ``dim``, in tp-rank order."""
    size = comm.world_size
    whole = torch.empty((size, *shard.shape), dtype=shard.dtype)
    comm.all_gather(whole, shard.contiguous())
    if dim == 0:
        return whole.reshape(size * shard.shape[0], shard.shape[1])
    return whole.permute(1, 0, 2).reshape(shard.shape[0], size * shard.shape[1])


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


def _check_param(p: torch.Tensor, group: Dict[str, Any]) -> None:
    if p.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"Muon: floating-point parameters only, got {p.dtype}")
    if group["use_muon"] and p.dim() != 2:
        raise ValueError(
            f"Muon: a use_muon group holds a parameter of shape {tuple(p.shape)}; Muon steps "
            "matrices only (put it in a use_muon=False group: dk.optim.muon_param_groups)"
        )
