"""ZeRO stage 3: the parameters of each unit of modules are gathered only while it runs.

Every rank keeps only its shard of the parameter values (``_FlatGroup.values``). A *unit* is a
submodule (a transformer block, an embedding) whose parameters are gathered together, as FSDP's
``fully_shard`` does per module; parameters outside every unit belong to the root module::

    forward   pre-hook(u):  wait for u's gather (or start it), prefetch the next unit
              post-hook(u): free u; hook u's outputs for backward
    backward  u's output gradient arrives: gather u again, prefetch the unit before it
              every gradient of u accumulated: its buckets go to the reduce-scatter, free u
    end of backward: free whatever is left

*Free* resizes the storage of the unit's full flat buffer to zero bytes and *gather* resizes it
back and all-gathers into it. The storage object stays the same, so the views autograd saved in
forward (``weight.t()`` of a linear, say) read the re-gathered values in backward: the
technique of FSDP. Activation checkpointing (``torch.utils.checkpoint``) works because a
forward that runs inside backward (the recomputation) gathers but does not free: the unit is
freed when its gradients are in.

Prefetch follows the order observed in the first iteration (forward and backward separately),
one unit ahead, with the gather running on the communicator's progress thread while this unit
computes. At most the root, the running unit (with the units it is nested in) and one
prefetched unit are gathered at a time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Set

import torch
from torch.utils._pytree import tree_flatten

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_LISTS = (torch.nn.ModuleList, torch.nn.ModuleDict)  # no forward of their own: never units


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def choose_units(root: torch.nn.Module, cap_bytes: int) -> List[torch.nn.Module]:
    """The default units: top-down, a child becomes a unit whole unless it is a
    ``ModuleList`` / ``ModuleDict`` (no forward of their own, so no hook would fire) or a
    ``Sequential`` bigger than ``cap_bytes``: their children are visited instead. Other
    modules are never split: their forward may use a child's parameters without calling the
    child (``MultiheadAttention`` uses ``out_proj.weight``)."""
    units: List[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            size = sum(p.numel() * p.element_size() for p in child.parameters())
            if size == 0:
                continue
            if isinstance(child, _LISTS) or (isinstance(child, _CONTAINERS) and size > cap_bytes):
                visit(child)
            else:
                units.append(child)

    visit(root)
    return units


class _Unit:
    """One unit's bookkeeping."""

    def __init__(self, index: int, module: torch.nn.Module, name: str) -> None:
        self.index, self.module, self.name = index, module, name
        self.groups: List[int] = []  # flat groups gathered with it
        self.gathered = False  # full storage allocated (values valid after ``works``)
        self.works: List[Any] = []  # all-gathers in flight
        self.grads_left = 0  # gradients of this unit still to accumulate in this backward
        self.numel_params = 0
        self.nbytes = 0


class ParameterGatherer:
    """Gathers and frees the units' full parameters around forward and backward (stage 3)."""

    def __init__(self, root: torch.nn.Module, units: Optional[Any], cap_bytes: int) -> None:
        self.root = root
        chosen = choose_units(root, cap_bytes) if units is None else list(units)
        names = {m: n for n, m in root.named_modules()}
        for m in chosen:
            if m not in names:
                raise ValueError(f"units: {type(m).__name__} is not a submodule of module")
        self.units = [_Unit(0, root, "<root>")]
        self.units += [_Unit(i + 1, m, names[m]) for i, m in enumerate(chosen)]
        self._unit_of = self._owners()
        self._handles: List[Any] = []
        self._flat_groups: List[Any] = []
        self.in_backward = False
        self._forward_order: List[int] = []
        self._backward_order: List[int] = []
        self._recording_forward = self._recording_backward = True
        self._cursor = 0
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0

    def _owners(self) -> Dict[int, int]:
        """id(parameter) -> the unit that gathers it: the innermost unit holding it, or, for a
        parameter two units hold side by side (a head tied to the embedding), the innermost
        unit containing both, else the root: gathered by one of them alone, it would be freed
        while the other still reads it."""
        holders: Dict[int, List[_Unit]] = {}
        for unit in self.units[1:]:
            for p in unit.module.parameters():
                holders.setdefault(id(p), []).append(unit)
        owners = {}
        for key, units in holders.items():
            innermost = [
                u
                for u in units
                if not any(o is not u and _contains(u.module, o.module) for o in units)
            ]
            if len(innermost) == 1:
                owners[key] = innermost[0].index
                continue
            around = [
                u
                for u in self.units[1:]
                if all(u is i or _contains(u.module, i.module) for i in innermost)
            ]
            around.sort(key=lambda u: sum(1 for o in around if _contains(o.module, u.module)))
            owners[key] = around[-1].index if around else 0
        return owners

    def unit_of_param(self, p: torch.Tensor) -> int:
        return self._unit_of.get(id(p), 0)

    def attach(self, flat_groups: List[Any]) -> None:
        """Links units to their flat groups (the optimizer's ``_FlatGroup`` s: each knows its
        unit, its full buffer and this rank's value shard) and registers the module hooks."""
        self._flat_groups = list(flat_groups)
        for g, fg in enumerate(self._flat_groups):
            unit = self.units[fg.unit]
            unit.groups.append(g)
            unit.numel_params += len(fg.params)
            unit.nbytes += fg.plan.numel * fg.flat.element_size()
        for unit in self.units:
            if unit is self.units[0]:
                self._handles.append(unit.module.register_forward_pre_hook(self._root_pre))
            self._handles.append(unit.module.register_forward_pre_hook(self._pre_hook(unit)))
            self._handles.append(unit.module.register_forward_hook(self._post_hook(unit)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def gathered_bound(self) -> int:
        """Bytes of at most three units (root, running, prefetched) plus one per nesting level."""
        sizes = sorted((u.nbytes for u in self.units[1:]), reverse=True)
        depth = max(
            (
                sum(1 for o in self.units[1:] if o is not u and _contains(o.module, u.module))
                for u in self.units[1:]
            ),
            default=0,
        )
        return self.units[0].nbytes + sum(sizes[: 2 + depth])

    # ----------------------------------------------------------------- gather / free

    def _start_gather(self, unit: _Unit) -> None:
        if unit.gathered or not unit.groups:
            return
        unit.gathered = True  # storage allocated; values valid once ``works`` are waited for
        for g in unit.groups:
            fg = self._flat_groups[g]
            comm = fg.comm  # the group's own ranks (MoE experts: their replicas)
            fg.flat.untyped_storage().resize_(fg.plan.numel * fg.flat.element_size())
            for b in fg.plan.buckets:
                out = fg.flat[b.start : b.start + b.numel]
                inp = fg.values[b.shard_offset : b.shard_offset + b.slice_numel]
                if comm.world_size == 1:
                    out.copy_(inp)
                else:
                    unit.works.append(comm.all_gather(out, inp, async_op=True))
        self.gathered_bytes += unit.nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _ensure_gathered(self, unit: _Unit) -> None:
        self._start_gather(unit)
        for work in unit.works:
            work.wait()
        unit.works = []

    def _free(self, unit: _Unit) -> None:
        if not unit.gathered:
            return
        for work in unit.works:
            work.wait()  # never free memory a collective still writes
        unit.works = []
        for g in unit.groups:
            self._flat_groups[g].flat.untyped_storage().resize_(0)
        unit.gathered = False
        self.gathered_bytes -= unit.nbytes

    @contextlib.contextmanager
    def all_gathered(self) -> Iterator[None]:
        """Every unit gathered (collective; for reading or saving full parameters)."""
        for unit in self.units:
            self._ensure_gathered(unit)
        try:
            yield
        finally:
            for unit in self.units:
                self._free(unit)

    # ----------------------------------------------------------------- hooks

    @staticmethod
    def _inside_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self._inside_backward():
            self._cursor = 0

    def _pre_hook(self, unit: _Unit):
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._ensure_gathered(unit)
            if self._inside_backward():
                return  # a recomputation (activation checkpointing): backward frees it
            if self._recording_forward:
                self._forward_order.append(unit.index)
            else:
                self._prefetch(self._forward_order, self._cursor)
            self._cursor += 1

        return hook

    def _post_hook(self, unit: _Unit):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._inside_backward():
                return
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward_hook(unit))
            self._free(unit)
            if unit is self.units[0]:
                self._recording_forward = False

        return hook

    def _pre_backward_hook(self, unit: _Unit):
        def hook(grad: torch.Tensor) -> None:
            if not self.in_backward:
                self._begin_backward()
            first = unit.index not in self._seen_in_backward
            self._seen_in_backward.add(unit.index)
            self._ensure_gathered(unit)
            if first:
                if self._recording_backward:
                    self._backward_order.append(unit.index)
                else:
                    self._prefetch(self._backward_order, self._backward_cursor)
                self._backward_cursor += 1

        return hook

    def _begin_backward(self) -> None:
        self.in_backward = True
        self._seen_in_backward: Set[int] = set()
        self._backward_cursor = 0
        for unit in self.units:
            unit.grads_left = unit.numel_params
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def _prefetch(self, order: List[int], position: int) -> None:
        if position + 1 < len(order):
            self._start_gather(self.units[order[position + 1]])

    def grad_ready(self, unit_index: int) -> None:
        """A gradient of unit ``unit_index`` accumulated; the unit is freed after its last."""
        if not self.in_backward:
            self._begin_backward()
        unit = self.units[unit_index]
        unit.grads_left -= 1
        if unit.grads_left == 0:
            self._free(unit)

    def end_backward(self) -> None:
        """Frees every unit still gathered (parameters that got no gradient keep theirs until
        here) and fixes the prefetch order after the first backward."""
        for unit in self.units:
            self._free(unit)
        self.in_backward = False
        self._recording_backward = False


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
