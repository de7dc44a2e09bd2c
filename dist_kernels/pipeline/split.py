"""One stage's backward in two halves: the input gradient now (I), the weight gradient later (W).

The zero-bubble split (Qi et al., ICLR 2024): I computes only what the previous stage waits
for, the gradient of the stage's inputs, so it can be sent upstream at once; W computes the
parameters' gradients later, where the schedule has a bubble to fill. Both halves run
autograd's own nodes, so every gradient is the one a full backward computes, bit for bit, and
W accumulates into ``.grad`` through the parameters' AccumulateGrad nodes (their hooks fire,
as in any backward).

Where the halves meet, in the autograd graph of one micro-batch::

    outputs --> ... --> X (on the input path) --> ... --> stage inputs        (I runs these)
                        |
                        +--> weight branch --> parameter                      (W runs these)

The *input path* is every node from which a stage input is reached. A parameter's weight
branch leaves it at one or more boundary nodes X (``AddmmBackward`` of a Linear, say); I runs
X, and a hook keeps the gradient that reached it. W restarts autograd at those nodes with the
kept gradients, towards the parameters only, one group of parameters at a time (parameters
whose branches share a boundary node form one group), so no node of the input path runs twice.
A branch that never meets the input path (the whole first stage, whose inputs are data)
restarts at the stage outputs with their gradients. While restarting, each boundary node's
incoming gradient is replaced by the kept one, so a boundary node below another is not counted
twice. The graph (the saved activations) lives until W has run, no longer.
"""

from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradient", "backward_input", "parameter_nodes"]


def _node_of(t: torch.Tensor) -> Optional[Node]:
    """``t``'s grad_fn, or for a leaf its AccumulateGrad node (None: no gradient)."""
    return get_gradient_edge(t).node if t.requires_grad else None


def parameter_nodes(params: Sequence[torch.Tensor]) -> List[Tuple[torch.Tensor, Node]]:
    """Each parameter with its AccumulateGrad node, for :func:`backward_input`. Holding the
    nodes keeps them alive, so every later graph uses the same ones: find them once."""
    return [(p, _node_of(p)) for p in params if p.requires_grad]


class _Graph:
    """Parents of every node reachable from the roots (a parent is nearer the outputs)."""

    def __init__(self, roots: Sequence[Node]) -> None:
        self.parents: Dict[Node, List[Node]] = {r: [] for r in roots}
        queue = deque(roots)
        while queue:
            node = queue.popleft()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                if child not in self.parents:
                    self.parents[child] = []
                    queue.append(child)
                self.parents[child].append(node)

    def above(self, starts: Sequence[Node]) -> Set[Node]:
        """Every node from which one of ``starts`` is reached (``starts`` included)."""
        seen = {s for s in starts if s in self.parents}
        queue = deque(seen)
        while queue:
            for parent in self.parents[queue.popleft()]:
                if parent not in seen:
                    seen.add(parent)
                    queue.append(parent)
        return seen


class _Group:
    """Parameters whose weight branches share boundary nodes, and where W restarts."""

    def __init__(self) -> None:
        self.params: List[torch.Tensor] = []
        self.boundary: Set[Node] = set()  # on the input path: their kept gradient restarts W
        self.roots: Set[int] = set()  # indices of outputs W restarts at (no input path there)


class WeightGradient:
    """The W half of one micro-batch's backward, after :func:`backward_input` ran its I half.

    Holds the autograd graph (the activations W needs) and the kept gradients until
    :meth:`run`; runs once.
    """

    def __init__(self, groups: List[_Group], kept: Dict[Node, tuple], roots, grads) -> None:
        self._groups, self._kept = groups, kept
        self._roots, self._grads = roots, grads

    def run(self, one_backward: bool = False) -> None:
        """Accumulates every parameter's gradient of this micro-batch into its ``.grad``.

        ``one_backward``: all groups in one autograd call instead of one call per group, for
        hooks that expect every parameter's gradient inside one backward (DDP's: its pass ends
        with the backward call that started it). It costs more: from a boundary node above
        another, the input path between them runs again (its result is then replaced by the
        kept gradient, so the gradients are the same).
        """
        if self._groups is None:
            raise RuntimeError("WeightGradient.run: this micro-batch's W has run already")
        groups, self._groups = self._groups, None
        if one_backward and groups:
            merged = _Group()
            for group in groups:
                merged.params += group.params
                merged.boundary |= group.boundary
                merged.roots |= group.roots
            groups = [merged]
        for group in groups:
            self._run_group(group)
        self._kept = self._roots = self._grads = None  # the graph goes with them

    def _run_group(self, group: _Group) -> None:
        edges, grads = [], []
        for node in group.boundary:
            for i, g in enumerate(self._kept.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        for i in sorted(group.roots):
            root = self._roots[i]
            edges.append(GradientEdge(root.grad_fn, root.output_nr))
            grads.append(self._grads[i])
        if not edges:
            return  # no gradient reached this group's branches: like a full backward
        clamps = [
            node.register_prehook(lambda _, kept=self._kept[node]: kept)
            for node in group.boundary
            if node in self._kept
        ]
        try:
            torch.autograd.backward(edges, grads, inputs=group.params)
        finally:
            for handle in clamps:
                handle.remove()


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[Tuple[torch.Tensor, Node]],
) -> WeightGradient:
    """Runs the I half: ``inputs`` (leaves) get their ``.grad``; returns the W half.

    ``roots`` are the stage's outputs (or its scaled loss), ``grads`` their gradients (None
    for a scalar loss), ``params`` the parameters whose gradients W computes, with their
    nodes (:func:`parameter_nodes`).
    """
    grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]
    root_nodes = [r.grad_fn for r in roots]
    graph = _Graph([n for n in root_nodes if n is not None])
    input_nodes = [n for n in map(_node_of, inputs) if n is not None]
    input_path = graph.above(input_nodes)
    groups = _group_params(graph, input_path, root_nodes, params)
    kept: Dict[Node, tuple] = {}
    boundary = {node for g in groups for node in g.boundary}
    hooks = [node.register_prehook(_keeper(kept, node)) for node in boundary]
    try:
        leaves = [t for t in inputs if t.requires_grad]
        reachable = [t for t, n in zip(roots, root_nodes) if n is not None and n in input_path]
        if leaves and reachable:
            pairs = [(r, g) for r, g, n in zip(roots, grads, root_nodes) if n in input_path]
            torch.autograd.backward(
                [r for r, _ in pairs], [g for _, g in pairs], inputs=leaves, retain_graph=True
            )
    finally:
        for handle in hooks:
            handle.remove()
    return WeightGradient(groups, kept, list(roots), grads)


def _keeper(kept: Dict[Node, tuple], node: Node):
    def keep(grad_outputs):
        kept[node] = tuple(grad_outputs)

    return keep


def _group_params(
    graph: _Graph, input_path: Set[Node], root_nodes: Sequence[Node], params
) -> List[_Group]:
    """Each parameter's boundary (module docstring); parameters sharing a boundary node or an
    output end up in one group (a union-find over those keys)."""
    root_index = {n: i for i, n in enumerate(root_nodes) if n is not None}
    leader: Dict[object, object] = {}  # key (boundary node, or ("root", i)) -> towards its set

    def find(key):
        while leader[key] is not key:
            leader[key] = leader[leader[key]]
            key = leader[key]
        return key

    reached = []
    for param, node in params:
        if node not in graph.parents:
            continue  # not in this micro-batch's graph: no gradient, as in a full backward
        boundary, roots = _boundary_of(graph, input_path, root_index, node)
        keys = [*boundary, *(("root", i) for i in roots)]
        for key in keys:
            leader.setdefault(key, key)
        for key in keys[1:]:
            leader[find(key)] = find(keys[0])
        reached.append((param, boundary, roots, keys[0]))
    groups: Dict[object, _Group] = {}
    for param, boundary, roots, key in reached:
        group = groups.setdefault(find(key), _Group())
        group.params.append(param)
        group.boundary |= boundary
        group.roots |= roots
    return list(groups.values())


def _boundary_of(graph: _Graph, input_path, root_index, node: Node) -> Tuple[Set[Node], Set[int]]:
    """Walks up a parameter's weight branch to where it meets the input path or an output."""
    boundary: Set[Node] = set()
    roots: Set[int] = set()
    seen = {node}
    queue = deque([node])
    while queue:
        current = queue.popleft()
        if current in root_index:
            roots.add(root_index[current])
        for parent in graph.parents[current]:
            if parent in input_path:
                boundary.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return boundary, roots
