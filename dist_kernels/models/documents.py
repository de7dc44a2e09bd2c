"""Documents packed into one sequence, kept apart: Megatron's ``--reset-attention-mask`` and
``--reset-position-ids``.

Pretraining data is a stream of documents, each ended by an end-of-document token (EOD),
cut into fixed-length samples, so a sample holds the end of one document and the start of
the next. By default every token attends to every earlier token of the sample and counts its
position from the sample's start. With these options each token attends only to the tokens
of its own document, and its position counts from that document's start, as if the document
had been run alone (Llama 3's document masking; torchtitan's ``--model.use_flex_attn``
``block_causal`` mask):

    ids        a  b  EOD c  d  EOD e
    document   0  0  0   1  1  1   2       an EOD belongs to the document it ends
    position   0  1  2   0  1  2   0

:class:`DocumentMasking` reads the ids once per forward (the GPT's embedding hands them over)
and holds the positions and the ``[b, 1, s, s]`` attention mask for the model's attention
layers until the next forward: so activation recomputation in backward, which runs the
blocks again after their micro-batch's forward and before the next, reads the same masks.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["DocumentMasking", "document_positions"]


def document_positions(ids: torch.Tensor, eod: int) -> tuple:
    """``(document index, position in the document)`` of every token of ``ids`` ``[b, s]``."""
    ends = ids == eod
    document = torch.cumsum(ends, dim=1) - ends.to(torch.int64)  # the EOD is its document's
    s = ids.shape[1]
    index = torch.arange(s, device=ids.device).expand_as(ids)
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]  # a document starts right after an EOD
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return document, index - first


class DocumentMasking:
    """The document boundaries of the batch in flight, shared by one GPT's embedding (which
    calls :meth:`observe` with the ids) and its attention layers (which read
    :attr:`positions` and :attr:`mask`)."""

    def __init__(
        self, eod: int, reset_attention_mask: bool = True, reset_position_ids: bool = True
    ) -> None:
        if not isinstance(eod, int) or isinstance(eod, bool) or eod < 0:
            raise ValueError(f"DocumentMasking: eod must be a token id (int >= 0), got {eod!r}")
        if not (reset_attention_mask or reset_position_ids):
            raise ValueError("DocumentMasking: neither the attention mask nor the positions reset")
        self.eod = eod
        self.reset_attention_mask = reset_attention_mask
        self.reset_position_ids = reset_position_ids
        self.positions: Optional[torch.Tensor] = None  # [b, s] when positions reset
        self.mask: Optional[torch.Tensor] = None  # [b, 1, s, s] bool, True: may attend

    def observe(self, ids: torch.Tensor) -> None:
        """Reads the boundaries of ``ids`` ``[b, s]`` (the whole sequences)."""
        document, position = document_positions(ids, self.eod)
        self.positions = position if self.reset_position_ids else None
        if self.reset_attention_mask:
            s = ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
            same = document[:, :, None] == document[:, None, :]
            self.mask = (same & causal).unsqueeze(1)
        else:
            self.mask = None

    def __repr__(self) -> str:
        return (
            f"DocumentMasking(eod={self.eod}, reset_attention_mask={self.reset_attention_mask}, "
            f"reset_position_ids={self.reset_position_ids})"
        )
