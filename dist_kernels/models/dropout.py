"""Dropout masks that do not depend on the parallel layout (counter-based).

torch's dropout draws its mask from a generator's stream, so the mask an element gets depends
on what this process drew before: on how many samples it holds (dp, gradient accumulation),
which heads and features (tp), which positions (sp, cp) and which layers (pp). Megatron
reseeds per tensor-parallel rank for that reason, and a run's result then changes with its
layout. Here an element's mask is a hash of *what the element is* instead:

    keep(seed, step, site, sample, coordinates...) = hash(...) >= p * 2**32

``sample`` is the sample's index in the step's global batch, ``site`` numbers the dropout
in the model, and the coordinates are global (a head's index among all heads, a token's
position in the whole sequence, a feature's index in the hidden state). Every layout, and
a recomputed forward, draws the same mask for the same element; a run resumed from a
checkpoint needs no generator state.

The hash is Wellons' ``lowbias32`` mixer (bijective on 32 bits), chained over the
coordinates from the slowest to the fastest: one full-size mix per mask, the rest on
per-sample and per-row tensors. The full-size mix is one C++ pass on CPU
(``ops.dropout_keep_mask``: 5-7x faster than ``bernoulli_``), int64 tensor ops elsewhere
(products kept below 2**48, so no signed overflow): every device gives the same bits.

The masks are used inside :func:`dropout_keys` (the driver opens one per micro-batch); outside
it :class:`SiteDropout` is ``nn.Dropout`` (torch's stream, as before).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn

from .. import ops
from .. import tensor_parallel as tp

_MASK32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers


def _mix(x: int) -> int:
    """lowbias32 of a Python int (the keys); the same function as :func:`_mix_tensor`."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _C1) & _MASK32
    x ^= x >> 15
    x = (x * _C2) & _MASK32
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)``: ``c`` in 16-bit halves, so no
    product passes 2**48 (a signed overflow would be undefined behaviour)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def site_key(seed: int, step: int, site: int) -> int:
    """The 32-bit key of one dropout site in one step."""
    return _mix(_mix(_mix(seed) ^ (step & _MASK32)) ^ (site & _MASK32))


def keep_mask(key: int, coords: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """Bool mask, True where an element is kept, of shape ``[len(c) for c in coords]``:
    element ``(i, j, ...)`` hashes ``key`` with ``coords[0][i]``, then ``coords[1][j]``, ...
    (non-negative global indices, int64, one 1-D tensor per dimension)."""
    if not coords[0].is_cpu:  # a GPU: torch's int64 ops, the same bits
        return keep_mask_reference(key, coords, p)
    h = torch.tensor(key, dtype=torch.int64)
    for d, c in enumerate(coords[:-1]):  # per row of the last dimension: small tensors
        h = _mix_tensor(h.unsqueeze(-1) ^ (c.to(torch.int64) & _MASK32).view([1] * d + [-1]))
    last = (coords[-1].to(torch.int64) & _MASK32).contiguous()
    # the full-size step in one C++ pass (torch's int64 ops take ~15)
    keep = ops.dropout_keep_mask(h.reshape(-1), last, round(p * 2**32))
    return keep.view(*h.shape, -1)


def keep_mask_reference(key: int, coords: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """:func:`keep_mask` in torch's int64 ops only (a GPU's path; the tests' reference)."""
    h = torch.tensor(key, dtype=torch.int64, device=coords[0].device)
    for d, c in enumerate(coords):
        h = _mix_tensor(h.unsqueeze(-1) ^ (c.to(torch.int64) & _MASK32).view([1] * d + [-1]))
    return h >= round(p * 2**32)


@dataclass
class _Keys:
    seed: int
    step: int
    first_sample: Union[int, Callable[[], int]]

    def samples(self, n: int, device: torch.device) -> torch.Tensor:
        first = self.first_sample() if callable(self.first_sample) else self.first_sample
        return torch.arange(first, first + n, device=device)


_ACTIVE: Optional[_Keys] = None  # a plain global: autograd may recompute on another thread


@contextlib.contextmanager
def dropout_keys(
    seed: int, step: int, first_sample: Union[int, Callable[[], int]] = 0
) -> Iterator[None]:
    """Inside the block (forward, backward and any recomputation of it) the model's
    :class:`SiteDropout` masks hash ``(seed, step, site, sample, coordinates)``: the rows of a
    batch are samples ``first_sample, first_sample + 1, ...`` of step ``step``'s global batch
    (``first_sample`` may be a callable, asked at each forward: a pipeline's micro-batch)."""
    global _ACTIVE
    saved, _ACTIVE = _ACTIVE, _Keys(int(seed), int(step), first_sample)
    try:
        yield
    finally:
        _ACTIVE = saved


def active_keys() -> Optional[_Keys]:
    """The keys of the enclosing :func:`dropout_keys`, or None."""
    return _ACTIVE


def apply_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with the dropped elements zeroed and the kept ones scaled by ``1 / (1 - p)``
    (``keep`` broadcast to ``x``); backward saves only the bool mask."""
    return torch.where(keep, x * (1.0 / (1.0 - p)), x.new_zeros(()))


class SiteDropout(nn.Dropout):
    """``nn.Dropout`` on the GPT's residual stream ``[s, b, h]``, site ``site``: inside
    :func:`dropout_keys` its masks are counter-based over (sample, position, feature), the
    position global under context and sequence parallelism; outside it, torch's dropout
    (on the tensor-parallel tracker's stream when the input is a sequence shard)."""

    def __init__(self, p: float, site: int) -> None:
        super().__init__(p)
        self.site = site
        self.sequence = None  # a context-parallel SequenceSharding (GPT.context_parallel)
        self.sp_rank, self.sp_size = 0, 1  # this rank's sequence shard (sequence parallel)

    def on_sequence_shards(self, rank: int, size: int) -> SiteDropout:
        """Called by ``tp.SequenceParallel``: the input is shard ``rank`` of ``size`` of the
        sequence."""
        self.sp_rank, self.sp_size = rank, size
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keys = active_keys()
        if keys is None:
            if self.sp_size == 1:
                return super().forward(x)
            with tp.get_rng_tracker().fork():  # the shards need masks of their own
                return super().forward(x)
        return self._counter(x, keys)

    @torch.compiler.disable  # the keys change every step: no graph guarded on them
    def _counter(self, x: torch.Tensor, keys: _Keys) -> torch.Tensor:
        s, b, h = x.shape
        positions = self.positions(s, x.device)
        coords = (keys.samples(b, x.device), positions, torch.arange(h, device=x.device))
        keep = keep_mask(site_key(keys.seed, keys.step, self.site), coords, self.p)
        return apply_mask(x, keep.permute(1, 0, 2), self.p)

    def positions(self, rows: int, device: torch.device) -> torch.Tensor:
        """The global sequence positions of an input's ``rows`` rows."""
        whole = rows * self.sp_size  # this context-parallel rank's tokens (all of them at cp 1)
        if self.sequence is None:
            pos = torch.arange(whole)
        else:  # zig-zag: its two chunks' positions
            pos = self.sequence.positions(whole)
        # sequence-parallel shards are the equal, ordered chunks of those
        return pos.chunk(self.sp_size)[self.sp_rank].to(device)


def attention_keep(
    site: int, keys: _Keys, b: int, heads: torch.Tensor, s: int, p: float, device: torch.device
) -> torch.Tensor:
    """The keep mask ``[b, heads, s, s]`` of attention probabilities: over (sample, global
    head, query position, key position); ``heads`` the global indices of this rank's heads."""
    pos = torch.arange(s, device=device)
    coords = (keys.samples(b, device), heads.to(device), pos, pos)
    return keep_mask(site_key(keys.seed, keys.step, site), coords, p)
