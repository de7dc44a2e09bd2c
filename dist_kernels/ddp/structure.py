"""The model structure every rank must share: descriptions compared before anything is broadcast.

Pure: parameters and buffers in, ``name shape dtype`` lines and the first mismatch out.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def describe_parameters(named: Sequence[Tuple[str, torch.Tensor]]) -> List[str]:
    """``name shape dtype`` lines that must agree across ranks before parameters are broadcast."""
    return [f"{name} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for name, t in named]


def first_description_mismatch(per_rank: Sequence[Sequence[str]]) -> Optional[str]:
    """None when all ranks describe the same model, else the first differing entry and ranks."""
    longest = max(len(d) for d in per_rank)
    for position in range(longest):
        entries = [d[position] if position < len(d) else "<missing>" for d in per_rank]
        if len(set(entries)) > 1:
            differing = [r for r, e in enumerate(entries) if e != entries[0]]
            shown = "; ".join(f"rank {r}: {e}" for r, e in enumerate(entries))
            return (
                f"DistributedDataParallel: models differ across ranks at entry {position} "
                f"(ranks {differing} differ from rank 0): {shown}"
            )
    return None
