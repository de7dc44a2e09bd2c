"""PowerSGD gradient compression (Vogels et al. 2019) as a DDP comm hook on our Communicator.

The algorithm, state and random-number use are torch's ``powerSGD_hook`` (torch 2.x,
``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``), so the same rank, seed and
start iteration give the same updates. Per bucket and synchronised backward, from iteration
``start_powerSGD_iter`` on:

1. error feedback: add last step's compression error to the bucket (this rank's gradients);
2. split the gradients: matrices worth compressing at rank r (``(n + m) r * min_compression_rate
   < n m``), and the rest (biases, small matrices), all-reduced uncompressed in one tensor;
3. Q (m x r): last step's Q (warm start) or a fresh Gaussian one, orthogonalised;
4. P = M Q; all-reduce P (sum); orthogonalise P;
5. Q = M^T P; all-reduce Q; Q /= world size;
6. M ~= P Q^T written into the bucket; error = what was to be sent - what was sent.

Before ``start_powerSGD_iter`` it is plain averaging. Orthogonalisation (Gram-Schmidt, or QR
above rank 2) runs in FP32 whatever the gradient dtype (torch runs it in FP16/BF16 for those).
A matrix n x m costs (n + m) r elements on the wire instead of n m.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Tuple

import torch

from ..buckets.comm_hook import GradBucket, all_reduce_future, average_future, check_state

__all__ = ["PowerSGDState", "powerSGD_hook"]


class PowerSGDState:
    """Hyperparameters and per-bucket memory of :func:`powerSGD_hook` (torch's fields).

    Args:
        process_group: None, or the DDP's Communicator or process group (reduce over the DDP's
            ranks; kept for torch's signature).
        matrix_approximation_rank: r, the rank of the approximation (1-4 typical; lower
            compresses more).
        start_powerSGD_iter: plain averaging for this many iterations first (> 1 with error
            feedback or warm start: the first iterations rebuild the buckets).
        min_compression_rate: compress a matrix only if n m / ((n + m) r) exceeds this.
        use_error_feedback: carry each step's compression error into the next.
        warm_start: start power iteration from last step's Q instead of a random one.
        orthogonalization_epsilon: added to column norms (0: exact; 1e-8 guards zero columns).
        random_seed: seed of the NumPy generator that seeds each bucket's random Q (as torch).
        compression_stats_logging_frequency: kept for torch's signature (no logging here).
        batch_tensors_with_same_shape: stack same-shaped matrices into one batched product.
    """

    __slots__ = [
        "process_group",
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "min_compression_rate",
        "orthogonalization_epsilon",
        "use_error_feedback",
        "warm_start",
        "batch_tensors_with_same_shape",
        "rng",
        "error_dict",
        "p_memory_dict",
        "q_memory_dict",
        "iter",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "compression_stats_logging_frequency",
    ]

    def __init__(
        self,
        process_group: Any,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        import numpy as np

        if matrix_approximation_rank < 1:
            raise ValueError(
                f"PowerSGDState: matrix_approximation_rank must be >= 1, got "
                f"{matrix_approximation_rank}"
            )
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "PowerSGDState: start_powerSGD_iter must be > 1 with use_error_feedback or "
                f"warm_start (got {start_powerSGD_iter}): DDP rebuilds its buckets after the "
                "first iteration, which would invalidate memory kept per bucket"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: Dict[int, torch.Tensor] = {}
        self.p_memory_dict: Dict[int, torch.Tensor] = {}
        self.q_memory_dict: Dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)

    def __getstate__(self) -> Dict[str, Any]:
        """Everything but the process group (not picklable), as torch's state."""
        return {s: getattr(self, s) for s in self.__slots__ if s != "process_group"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.process_group = None
        for slot, value in state.items():
            setattr(self, slot, value)

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Counts iterations: one per backward, on its last bucket."""
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> Tuple[float, int, int]:
        """(rate, elements before, elements after) over every compressed step so far."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after


# ------------------------------------------------------------------------ linear algebra


def _orthogonalize(matrices: torch.Tensor, epsilon: float) -> None:
    """Orthonormalises the columns of each matrix of a batch [b, n, r] in place, in FP32.

    Gram-Schmidt up to rank 2, QR above (torch's choice; QR is faster there). A 16-bit batch
    is orthogonalised in an FP32 copy and written back once.
    """
    work = matrices if matrices.dtype == torch.float32 else matrices.float()
    rank = work.shape[2]
    if rank <= 2:
        _gram_schmidt(work, epsilon)
    else:
        q = torch.empty(work.shape[0], rank, rank, dtype=work.dtype, device=work.device)
        torch.linalg.qr(work, out=(work, q))
    if work is not matrices:
        matrices.copy_(work)


def _gram_schmidt(matrices: torch.Tensor, epsilon: float) -> None:
    columns = matrices.shape[2]
    for i in range(columns):
        col = matrices[:, :, i : i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= norm + epsilon if epsilon else norm  # torch adds no 0: same bits
        if i + 1 < columns:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def _worth_compressing(n: int, m: int, rank: int, min_rate: float) -> bool:
    return (n + m) * rank * min_rate < n * m


# ------------------------------------------------------------------------ one bucket


class _BucketRound:
    """The matrices of one bucket and where their P and Q live in the bucket's memory."""

    def __init__(self, state: PowerSGDState, bucket: GradBucket) -> None:
        self.state, self.bucket = state, bucket
        self.index = bucket.index()
        self.matrices: List[torch.Tensor] = []  # [b, n, m] views of the gradients (or stacks)
        self.uncompressed: List[torch.Tensor] = []
        self._split(bucket.gradients())

    def _split(self, gradients: List[torch.Tensor]) -> None:
        state = self.state
        by_shape: Dict[torch.Size, List[torch.Tensor]] = collections.defaultdict(list)
        for tensor in gradients:
            matrix = tensor.view(tensor.shape[0], -1) if tensor.dim() else tensor.view(1, 1)
            n, m = matrix.shape
            rank = min(n, m, state.matrix_approximation_rank)
            state.total_numel_before_compression += n * m
            if _worth_compressing(n, m, rank, state.min_compression_rate):
                by_shape[matrix.shape].append(matrix)
                state.total_numel_after_compression += (n + m) * rank
            else:
                self.uncompressed.append(tensor)
                state.total_numel_after_compression += n * m
        self.by_shape = by_shape
        for same in by_shape.values():
            if state.batch_tensors_with_same_shape and len(same) > 1:
                self.matrices.append(torch.stack(same))
            else:
                self.matrices.extend(t.unsqueeze(0) for t in same)

    def factors(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Views [b, n, r] into the bucket's P memory and [b, m, r] into its Q memory."""
        state, ps, qs = self.state, [], []
        sizes = [(b, n, m, min(n, m, state.matrix_approximation_rank)) for b, n, m in
                 (t.shape for t in self.matrices)]  # fmt: skip
        fresh = not state.warm_start or self.index not in state.p_memory_dict
        if fresh:
            dtype, device = self.bucket.buffer().dtype, self.bucket.buffer().device
            p_total = sum(b * n * r for b, n, _, r in sizes)
            q_total = sum(b * m * r for b, _, m, r in sizes)
            state.p_memory_dict[self.index] = torch.empty(p_total, dtype=dtype, device=device)
            state.q_memory_dict[self.index] = torch.empty(q_total, dtype=dtype, device=device)
        p_at = q_at = 0
        for b, n, m, r in sizes:
            ps.append(state.p_memory_dict[self.index][p_at : p_at + b * n * r].view(b, n, r))
            qs.append(state.q_memory_dict[self.index][q_at : q_at + b * m * r].view(b, m, r))
            p_at += b * n * r
            q_at += b * m * r
        self._init_qs(qs, fresh)
        return ps, qs

    def _init_qs(self, qs: List[torch.Tensor], fresh: bool) -> None:
        """Warm start: orthogonalise last step's Q. Else a Gaussian Q from the bucket's seed,
        drawn on the CPU with torch's generator seeded from the state's NumPy generator (one
        draw per bucket), so every rank and torch's hook draw the same numbers."""
        epsilon = self.state.orthogonalization_epsilon
        if not fresh:
            for q in qs:
                _orthogonalize(q, epsilon)
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=q.dtype))
                _orthogonalize(q, epsilon)

    def write_back_stacks(self) -> None:
        """With batching, the stacked results go back into the gradients they were copied
        from."""
        if not self.state.batch_tensors_with_same_shape:
            return
        for stack in self.matrices:
            if stack.shape[0] > 1:
                for i, original in enumerate(self.by_shape[stack.shape[1:]]):
                    original.copy_(stack[i])


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """PowerSGD compression of one bucket (torch's ``powerSGD_hook``, on our Communicator).

    Three all-reduces per compressed bucket (uncompressed tensors, P, Q) instead of one of the
    whole bucket. The returned Future's value is the bucket buffer holding the decompressed
    average; it completes at the end of backward (see :mod:`dist_kernels.ddp.hooks`).
    """
    check_state(state.process_group, bucket, "powerSGD_hook")
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return average_future(bucket, buffer)
    world = bucket._reductions.comm.world_size
    to_send = _add_error_feedback(state, bucket)
    round_ = _BucketRound(state, bucket)
    ps, qs = round_.factors()
    for matrix, q, p in zip(round_.matrices, qs, ps):
        torch.bmm(matrix, q, out=p)
    result: torch.futures.Future = torch.futures.Future()

    def step(fn):
        """A ``then`` callback that hands any exception to ``result`` (never left pending)."""

        def callback(future: torch.futures.Future) -> None:
            try:
                fn(future)
            except BaseException as e:  # noqa: BLE001 - reported through the Future
                result.set_exception(e)

        return callback

    @step
    def after_uncompressed(future: torch.futures.Future) -> None:
        flat = future.value().div_(world)
        at = 0
        for tensor in round_.uncompressed:
            tensor.copy_(flat[at : at + tensor.numel()].view_as(tensor))
            at += tensor.numel()
        _reduce_then(bucket, state.p_memory_dict[round_.index], after_p)

    @step
    def after_p(future: torch.futures.Future) -> None:
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for matrix, p, q in zip(round_.matrices, ps, qs):
            torch.bmm(matrix.transpose(1, 2), p, out=q)
        _reduce_then(bucket, state.q_memory_dict[round_.index], after_q)

    @step
    def after_q(future: torch.futures.Future) -> None:
        future.value().div_(world)
        for p, q, matrix in zip(ps, qs, round_.matrices):
            torch.bmm(p, q.transpose(1, 2), out=matrix)
        round_.write_back_stacks()
        if state.use_error_feedback:
            state.error_dict[round_.index] = to_send - buffer
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        result.set_result(buffer)

    flat = (
        torch.cat([t.reshape(-1) for t in round_.uncompressed])
        if round_.uncompressed
        else torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    )
    _reduce_then(bucket, flat, after_uncompressed)
    return result


def _reduce_then(bucket: GradBucket, tensor: torch.Tensor, callback) -> None:
    """All-reduce, then ``callback``; an empty tensor (nothing of that kind in the bucket) is
    not sent, on any rank, and the callback runs at once."""
    if tensor.numel():
        all_reduce_future(bucket, tensor).then(callback)
        return
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    callback(done)


def _add_error_feedback(state: PowerSGDState, bucket: GradBucket) -> torch.Tensor:
    """Adds last step's error to the buffer; returns a copy of what is to be sent."""
    buffer = bucket.buffer()
    if not state.use_error_feedback:
        return buffer
    error = state.error_dict.get(bucket.index())
    if error is not None:
        buffer.add_(error)
    else:
        state.error_dict[bucket.index()] = torch.zeros_like(buffer)
    return buffer.detach().clone()
