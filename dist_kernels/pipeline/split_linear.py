"""The B/W split for stages made of ``nn.Linear``: one matmul per Linear in W, no graph walks.

The generic split (:mod:`.split`) finds where each parameter's branch meets the input path by
walking the autograd graph of every micro-batch in Python and restarts autograd once per group
in W; on a stage of small Linears that costs more than the bubble W fills. Most pipeline
stages are Linears between parameter-free ops (an MLP, the projections of a transformer block
without its norms), and there the split is known in advance, as in the zero-bubble authors'
``WeightGradStore`` and Megatron's ``--delay-wgrad-compute``:

* F is the stage's ordinary forward; a forward hook on each Linear (installed once,
  :class:`Recorder`) records its input and the gradient edge of its output
  (``AddmmBackward``'s, where the weight branch leaves);
* I is one ``torch.autograd.grad`` towards the stage inputs and those edges: autograd runs the
  input path only (each ``AddmmBackward`` computes its input's gradient, never its weight's:
  no parameter's AccumulateGrad is on the way) and hands back each Linear's output gradient;
* W does, per recorded Linear, ``grad_weight = grad_output^T @ input`` and ``grad_bias =
  grad_output.sum(0)``, the same ATen calls autograd's ``AddmmBackward`` makes (so the same
  bits), and accumulates them into ``.grad`` as AccumulateGrad does: by hand where a parameter
  has no hooks (an autograd call costs more than these matmuls on small Linears), else through
  the parameters' AccumulateGrad nodes in one ``torch.autograd.backward`` (so their hooks, DDP's
  among them, fire inside one backward call).

:func:`supports` says whether a stage can take this path: every trainable parameter must be the
weight or bias of a module whose type is exactly ``nn.Linear`` (a subclass may change
``forward``). A micro-batch whose recording does not fit (a Linear called with a keyword, or
given a non-contiguous input of more than 2 dims, where ``F.linear`` takes another matmul path,
or whose output is a view modified in place later) returns None from
:func:`backward_input_linear`: the caller runs the generic split on it. An output that is not a
view may be modified in place (``ReLU(inplace=True)``): its edge stays in the graph.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge

__all__ = [
    "LinearWeightGradient",
    "Recorder",
    "Recording",
    "backward_input_linear",
    "linear_modules",
    "record_linears",
    "supports",
]


def linear_modules(module: nn.Module) -> List[nn.Linear]:
    """The plain ``nn.Linear`` modules of ``module`` (each once)."""
    return [m for m in module.modules() if type(m) is nn.Linear]


def supports(module: nn.Module) -> bool:
    """Whether every trainable parameter of ``module`` is a plain Linear's weight or bias."""
    covered = {id(p) for m in linear_modules(module) for p in (m.weight, m.bias) if p is not None}
    trainable = [p for p in module.parameters() if p.requires_grad]
    return bool(trainable) and all(id(p) in covered for p in trainable)


class Recording:
    """What the forward of one micro-batch recorded: per Linear call, the module, its input
    (and that input's version) and its output's gradient edge."""

    __slots__ = ("calls", "fits", "views")

    def __init__(self) -> None:
        # (module, input, its version, the output's grad_fn and output_nr: its gradient edge)
        self.calls: List[Tuple[nn.Linear, torch.Tensor, int, Any, int]] = []
        self.fits = True  # False: a call this path cannot split; use the generic split
        # Outputs that are views (F.linear of a 3-D input reshapes addmm's result), with their
        # versions: modified in place later, their edge leaves the graph (autograd rebases a
        # view modified in place), so the micro-batch takes the generic split.
        self.views: List[Tuple[torch.Tensor, int]] = []

    def hook(self, module: nn.Linear, args: tuple, out: torch.Tensor) -> None:
        # As little as can be here: it runs in every Linear call of the forward.
        if len(args) != 1:
            self.fits = False
            return
        x = args[0]
        self.calls.append((module, x, x._version, out.grad_fn, out.output_nr))
        if out._base is not None:
            self.views.append((out, out._version))

    def still_fits(self) -> bool:
        if not self.fits:
            return False
        for _, x, _, grad_fn, _ in self.calls:
            if grad_fn is None or (x.dim() > 2 and not x.is_contiguous()):
                return False
        return all(out._version == v for out, v in self.views)


class Recorder:
    """One forward hook per Linear, installed once: it records into the :class:`Recording` set
    by :meth:`recording` and does nothing outside it. (Registering and removing hooks around
    every forward costs several times what the hooks themselves do.)"""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.current: Optional[Recording] = None
        self.handles = [m.register_forward_hook(self._hook) for m in linears]

    def _hook(self, module: nn.Linear, args: tuple, out: torch.Tensor) -> None:
        current = self.current
        if current is not None:
            current.hook(module, args, out)

    @contextlib.contextmanager
    def recording(self, recording: Recording) -> Iterator[None]:
        self.current = recording
        try:
            yield
        finally:
            self.current = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@contextlib.contextmanager
def record_linears(linears: Sequence[nn.Linear], recording: Recording) -> Iterator[None]:
    """While open, every call of one of ``linears`` is recorded into ``recording``."""
    handles = [m.register_forward_hook(recording.hook) for m in linears]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class LinearWeightGradient:
    """The W half of one micro-batch: the recorded Linears' weight and bias gradients."""

    def __init__(self, stash: List[Tuple[nn.Linear, torch.Tensor, int, torch.Tensor]]) -> None:
        self._stash: Optional[list] = stash

    def run(self) -> None:
        """Accumulates each recorded Linear's gradients into ``.grad``."""
        if self._stash is None:
            raise RuntimeError("LinearWeightGradient.run: this micro-batch's W has run already")
        stash, self._stash = self._stash, None
        by_hand = _by_hand([p for m, _, _, _ in stash for p in (m.weight, m.bias)])
        params, grads = [], []
        with torch.no_grad():
            for module, x, version, grad_out in stash:
                if x._version != version:  # as autograd's check of a saved tensor
                    raise RuntimeError(
                        "the input of a Linear (needed for its weight gradient) has been "
                        "modified by an inplace operation after the forward"
                    )
                if grad_out.dim() != 2:
                    grad_out = grad_out.reshape(-1, grad_out.shape[-1])
                    x = x.reshape(-1, x.shape[-1])
                if x.dtype != grad_out.dtype:  # under autocast the matmul took x cast so
                    x = x.to(grad_out.dtype)
                weight, bias = module.weight, module.bias
                held = weight.grad
                if (
                    weight.requires_grad
                    and by_hand
                    and held is not None
                    and held.dtype == grad_out.dtype
                ):
                    # Into a product buffer kept per shape, then added as AccumulateGrad adds:
                    # no 1 MiB product per 512 x 512 layer to allocate. (Megatron's fusion,
                    # held.addmm_(grad_out^T, x) with beta = 1, sums in another order on some
                    # BLAS paths, MKL's AVX2 one among them: not a full backward's bits.)
                    product = _product_buffer(held)
                    torch.mm(grad_out.t(), x, out=product)
                    held.add_(product)
                elif weight.requires_grad:
                    # What AddmmBackward / MmBackward compute for weight.t() (then transposed
                    # back): grad_output^T @ input, one matmul.
                    params.append(weight)
                    grads.append(grad_out.t().mm(x))
                if bias is not None and bias.requires_grad:
                    params.append(bias)
                    grads.append(grad_out.sum(0))
                if by_hand:  # at once, so that each gradient's memory is reused while warm
                    for p, g in zip(params, grads):
                        _accumulate(p, g)
                    params, grads = [], []
        if params:
            # The parameters' own AccumulateGrad nodes, as roots: .grad and hooks as in any
            # backward (a Linear called twice in the micro-batch gets both, summed here).
            torch.autograd.backward(params, grads)


# One product buffer per (shape, dtype, device) of weight: W runs on the rank's one thread,
# and a stage's Linears come in few shapes, so this holds about one weight of each.
_PRODUCTS: Dict[Tuple[Tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


def _product_buffer(like: torch.Tensor) -> torch.Tensor:
    key = (tuple(like.shape), like.dtype, like.device)
    buffer = _PRODUCTS.get(key)
    if buffer is None:
        buffer = _PRODUCTS[key] = torch.empty_like(like, memory_format=torch.contiguous_format)
    return buffer


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """What AccumulateGrad does for a dense gradient in its parameter's layout (autograd casts
    a gradient to its parameter's dtype first)."""
    if g.dtype != p.dtype:
        g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


def _by_hand(params: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether accumulating by hand is what AccumulateGrad would do: each trainable parameter
    once, no hooks on it (DDP's among them), dense and contiguous (the layout of the
    gradients W computes), with a ``.grad`` (if any) of that layout and dtype too."""
    params = [p for p in params if p is not None and p.requires_grad]
    if len({id(p) for p in params}) != len(params):
        return False
    for p in params:
        if p._backward_hooks or p._post_accumulate_grad_hooks or p.is_sparse:
            return False
        if not p.is_contiguous():
            return False
        held = p.grad
        if held is not None and (
            held.is_sparse or not held.is_contiguous() or held.dtype != p.dtype
        ):
            return False
    return True


def backward_input_linear(
    roots: Sequence[torch.Tensor],
    grads: Optional[Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    recording: Recording,
) -> Optional[LinearWeightGradient]:
    """Runs the I half: ``inputs`` (leaves) get their ``.grad``; returns the W half, or None
    (nothing run) when the recording does not fit this path.

    ``roots`` are the stage's outputs (or its scaled loss), ``grads`` their gradients (None for
    a scalar loss).
    """
    if not recording.still_fits():
        return None
    leaves = [t for t in inputs if t.requires_grad]
    edges = [GradientEdge(grad_fn, nr) for _, _, _, grad_fn, nr in recording.calls]
    if not leaves and not edges:
        return LinearWeightGradient([])
    found = torch.autograd.grad(roots, [*leaves, *edges], grads, allow_unused=True)
    for leaf, g in zip(leaves, found):
        if g is not None:
            leaf.grad = g if leaf.grad is None else leaf.grad + g
    stash = [
        (module, x, version, g)
        for (module, x, version, _, _), g in zip(recording.calls, found[len(leaves) :])
        if g is not None  # a Linear whose output no root uses: no gradient, as in a backward
    ]
    return LinearWeightGradient(stash)
