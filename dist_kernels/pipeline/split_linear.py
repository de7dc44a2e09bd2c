"""The B/W split for stages made of ``nn.Linear``: one matmul per Linear in W, no graph walks.

The generic split (:mod:`.split`) finds where each parameter's branch meets the input path by
walking the autograd graph of every micro-batch in Python and restarts autograd once per group
in W; on a stage of small Linears that costs more than the bubble W fills. Most pipeline
stages are Linears between parameter-free ops (an MLP, the projections of a transformer block
without its norms), and there the split is known in advance, as in the zero-bubble authors'
``WeightGradStore`` and Megatron's ``--delay-wgrad-compute``:

* F runs each Linear through :class:`_DeferredLinear` (an autograd Function) that computes
  ``F.linear`` as usual but sees its weight and bias detached, so the autograd graph of the
  micro-batch never reaches a parameter;
* I is then one ordinary ``torch.autograd.backward`` of the stage: each Linear's backward
  computes only ``grad_input = grad_output @ weight`` and stashes ``(input, grad_output)``;
* W does, per stashed Linear, ``grad_weight = grad_output^T @ input`` and ``grad_bias =
  grad_output.sum(0)``, the same ATen calls autograd's ``AddmmBackward`` makes (so the same
  bits), and accumulates them into ``.grad`` as AccumulateGrad does: by hand where a parameter
  has no hooks (an autograd call costs more than these matmuls on small Linears), else through
  the parameters' AccumulateGrad nodes in one ``torch.autograd.backward`` (so their hooks, DDP's
  among them, fire inside one backward call).

A Linear given a non-contiguous input of more than 2 dims is the exception: ``F.linear`` picks
its matmul path there by which operands require grad, so F builds ``F.linear``'s own graph on
stand-ins of its operands and I and W differentiate that graph, each for its own operands.

:func:`supports` says whether a stage can take this path: every trainable parameter must be the
weight or bias of a module whose type is exactly ``nn.Linear`` (a subclass may change
``forward``). Other stages use the generic split.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LinearWeightGradient", "deferred_linears", "linear_modules", "supports"]

# (module, input, grad_output) of one Linear's backward in one micro-batch; for a
# non-contiguous input, (module, (F.linear's output, its operands' stand-ins), grad_output)
_Entry = Tuple[nn.Linear, Any, torch.Tensor]


def linear_modules(module: nn.Module) -> List[nn.Linear]:
    """The plain ``nn.Linear`` modules of ``module`` (each once)."""
    return [m for m in module.modules() if type(m) is nn.Linear]


def supports(module: nn.Module) -> bool:
    """Whether every trainable parameter of ``module`` is a plain Linear's weight or bias."""
    covered = {id(p) for m in linear_modules(module) for p in (m.weight, m.bias) if p is not None}
    trainable = [p for p in module.parameters() if p.requires_grad]
    return bool(trainable) and all(id(p) in covered for p in trainable)


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward computes the input gradient and stashes the rest for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, anchor, site):
        # ``weight`` and ``bias`` arrive detached: nothing here reaches a parameter. ``anchor``
        # (an empty leaf that requires grad) makes the output require grad even when ``x``
        # does not (data into the first stage), so its backward still runs and stashes.
        module = site.module
        ctx.site, ctx.local = site, None
        if x.dim() <= 2 or x.is_contiguous():
            ctx.save_for_backward(x, weight)
            return F.linear(x, weight, bias)
        # A non-contiguous input of more than 2 dims: F.linear picks its matmul path by which
        # operands require grad (batched, not folded), so the matmuls above would round
        # differently. Build F.linear's own graph here, on stand-ins that require grad as the
        # real operands do, and let I and W differentiate it, each for its own operands.
        with torch.enable_grad():
            local = [
                x.detach().requires_grad_(ctx.needs_input_grad[0]),
                weight.detach().requires_grad_(module.weight.requires_grad),
                None if bias is None else bias.detach().requires_grad_(module.bias.requires_grad),
            ]
            out = F.linear(*local)
        ctx.local = (out, local)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.local is not None:
            out, local = ctx.local
            ctx.local = None
            if ctx.needs_input_grad[0]:
                (grad_x,) = torch.autograd.grad(out, local[0], grad_out, retain_graph=True)
            ctx.site.stash.append((ctx.site.module, (out, local), grad_out))
            return grad_x, None, None, None, None
        x, weight = ctx.saved_tensors
        if ctx.needs_input_grad[0]:
            # AddmmBackward's input gradient: grad_output.mm(weight), on 2-D views.
            flat = grad_out.reshape(-1, grad_out.shape[-1])
            grad_x = flat.mm(weight).view(x.shape)
        ctx.site.stash.append((ctx.site.module, x, grad_out))
        return grad_x, None, None, None, None


class LinearWeightGradient:
    """The W half of one micro-batch: the stashed Linears' weight and bias gradients."""

    def __init__(self, stash: List[_Entry]) -> None:
        self._stash: Optional[List[_Entry]] = stash

    def run(self) -> None:
        """Accumulates each stashed Linear's gradients into ``.grad`` (one backward call)."""
        if self._stash is None:
            raise RuntimeError("LinearWeightGradient.run: this micro-batch's W has run already")
        stash, self._stash = self._stash, None
        params, grads = [], []
        for module, x, grad_out in stash:
            if isinstance(x, tuple):  # F.linear's own graph (a non-contiguous input)
                params_here, grads_here = _local_grads(module, *x, grad_out)
                params += params_here
                grads += grads_here
                continue
            flat_g = grad_out.reshape(-1, grad_out.shape[-1])
            if module.weight.requires_grad:
                # What AddmmBackward / MmBackward compute for weight.t() (then transposed
                # back): grad_output^T @ input, one matmul.
                params.append(module.weight)
                grads.append(flat_g.t().mm(x.reshape(-1, x.shape[-1])))
            if module.bias is not None and module.bias.requires_grad:
                params.append(module.bias)
                grads.append(flat_g.sum(0))
        if params and all(map(_plain, params, grads)) and len(set(map(id, params))) == len(params):
            # What AccumulateGrad does for a dense gradient of the parameter's layout, with
            # no hook to run (autograd's own call costs more than the matmuls here).
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad += g
        elif params:
            # The parameters' own AccumulateGrad nodes, as roots: .grad and hooks as in any
            # backward (a Linear used twice in the micro-batch gets both, summed here).
            torch.autograd.backward(params, grads)


def _plain(p: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether accumulating ``g`` into ``p.grad`` by hand is what AccumulateGrad would do: no
    hooks on ``p`` (DDP's among them), dense tensors, ``g`` in ``p``'s layout, and a ``.grad``
    (if any) of that layout too."""
    if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
        return False
    if p.is_sparse or g.is_sparse or g.stride() != p.stride() or g.dtype != p.dtype:
        return False
    return p.grad is None or (p.grad.stride() == p.stride() and not p.grad.is_sparse)


def _local_grads(module: nn.Linear, out, local, grad_out):
    """The parameters' gradients from the graph F.linear built in the forward."""
    pairs = [(p, t) for p, t in zip((module.weight, module.bias), local[1:]) if p is not None]
    pairs = [(p, t) for p, t in pairs if p.requires_grad]
    if not pairs:
        return [], []
    grads = torch.autograd.grad(out, [t for _, t in pairs], grad_out)
    return [p for p, _ in pairs], list(grads)


@contextlib.contextmanager
def deferred_linears(linears: Sequence[nn.Linear], stash: List[_Entry]) -> Iterator[None]:
    """While open, the forward of each of ``linears`` defers its weight gradient to ``stash``."""
    anchor = torch.empty(0, requires_grad=True)
    for module in linears:
        module.forward = _forward_of(module, anchor, stash)  # instance attribute: hooks stay
    try:
        yield
    finally:
        for module in linears:
            del module.forward


class _Site:
    """A Linear and the stash its backward appends to: one opaque argument of the Function
    (a list among the arguments would be walked by ``Function.apply`` at every call)."""

    __slots__ = ("module", "stash")

    def __init__(self, module: nn.Linear, stash: List[_Entry]) -> None:
        self.module, self.stash = module, stash


def _forward_of(module: nn.Linear, anchor: torch.Tensor, stash: List[_Entry]):
    site = _Site(module, stash)
    apply = _DeferredLinear.apply

    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = module.bias.detach() if module.bias is not None else None
        return apply(x, module.weight.detach(), bias, anchor, site)

    return forward
