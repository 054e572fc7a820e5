"""The batch triple: train_batch_size = micro_batch * grad_accum * data_parallel_size."""
from __future__ import annotations

from dataclasses import dataclass


DEFAULT_MICRO_BATCH = 4


@dataclass(frozen=True)
class BatchTriple:
    global_batch: int
    micro_batch: int
    grad_accum: int
    dp_size: int

    def __str__(self) -> str:
        return (f"train_batch_size {self.global_batch} = micro {self.micro_batch} x accum {self.grad_accum} "
                f"x data-parallel {self.dp_size}")


def solve_batch(global_batch: int | None, micro_batch: int | None, grad_accum: int | None,
                dp_size: int) -> BatchTriple:
    """Derive the missing members of the triple; with all three given, check them.

    With fewer than two given, micro_batch defaults to 4 and then grad_accum to 1.
    """
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        if value is not None and value <= 0:
            raise ValueError(f"batch.{name}={value}: must be a positive integer")
    given = sum(v is not None for v in (global_batch, micro_batch, grad_accum))
    if given < 2 and micro_batch is None:
        micro_batch = DEFAULT_MICRO_BATCH if global_batch is None else largest_divisor_upto(
            global_batch // dp_size if global_batch % dp_size == 0 else 1, DEFAULT_MICRO_BATCH)
    if global_batch is None:
        grad_accum = grad_accum or 1
        return BatchTriple(micro_batch * grad_accum * dp_size, micro_batch, grad_accum, dp_size)
    if micro_batch is None:
        micro_batch = _exact(global_batch, grad_accum * dp_size, "micro_batch", global_batch, grad_accum, dp_size)
    elif grad_accum is None:
        grad_accum = _exact(global_batch, micro_batch * dp_size, "grad_accum", global_batch, micro_batch, dp_size)
    if micro_batch * grad_accum * dp_size != global_batch:
        raise ValueError(
            f"batch triple inconsistent: train_batch_size {global_batch} != micro {micro_batch} x accum {grad_accum} "
            f"x data-parallel {dp_size} (= {micro_batch * grad_accum * dp_size}); give only two of the three "
            "and bigtrain derives the third")
    return BatchTriple(global_batch, micro_batch, grad_accum, dp_size)


def rescale_for_world(triple: BatchTriple, dp_size: int) -> tuple[BatchTriple, str]:
    """Fit a triple written for one data-parallel size to another, keeping the global batch if possible.

    Returns the new triple and a one-line explanation for the log (empty when nothing changed).
    """
    if dp_size == triple.dp_size:
        return triple, ""
    per_rank = triple.global_batch / dp_size
    if per_rank == int(per_rank) and int(per_rank) % triple.micro_batch == 0:
        new = BatchTriple(triple.global_batch, triple.micro_batch, int(per_rank) // triple.micro_batch, dp_size)
        how = "kept the global batch and micro-batch, changed gradient accumulation"
    else:
        new = BatchTriple(triple.micro_batch * triple.grad_accum * dp_size, triple.micro_batch, triple.grad_accum,
                          dp_size)
        how = (f"global batch {triple.global_batch} is not a multiple of micro {triple.micro_batch} x "
               f"data-parallel {dp_size}, so kept micro-batch and accumulation and changed the global batch")
    return new, f"batch triple recomputed for data-parallel size {dp_size} (was {triple.dp_size}): {new}; {how}"


def _exact(total: int, divisor: int, name: str, global_batch: int, other: int, dp_size: int) -> int:
    if total % divisor:
        raise ValueError(f"batch.global_batch={global_batch} is not divisible by {divisor} "
                         f"(the other batch member {other} x data-parallel {dp_size}), so batch.{name} "
                         "cannot be derived; change global_batch or give all three consistently")
    return total // divisor


def largest_divisor_upto(n: int, cap: int) -> int:
    """The largest divisor of n that is <= cap (1 at least): a micro-batch that keeps a rank's share of the
    global batch whole."""
    return max(d for d in range(1, max(1, min(n, cap)) + 1) if n % d == 0) if n >= 1 else 1
