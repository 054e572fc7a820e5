"""The batch triple, train_batch_size = micro_batch * grad_accum * data_parallel_size: solving it, fitting one written
for another world size, and choosing it for a job from what the user, a JSON, a checkpoint and the run config say.
All of bigtrain's batch arithmetic lives here."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping

from bigtrain.config.run_config import RunConfig
from bigtrain.ds.keys import BATCH_FIELDS, BATCH_KEYS
from bigtrain.ds.lint import LintError, holds_nowhere
from bigtrain.config.topology import Topology


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


MEMBERS = ("global_batch", "micro_batch", "grad_accum")
KEEP_FIRST = ("micro_batch", "global_batch", "grad_accum")  # on a tie: memory per rank, then the dynamics
# How strongly a batch member's source holds when the triple must be refitted (higher is kept).
SET, CHECKPOINT, JSON, CONFIG = 4, 3, 2, 1


# --- fitting a triple to a job: what the user gave, how strongly, and the world ------------------------------------------------------------------------------

def user_batch(said: dict, run: RunConfig, world_size: int | None, sources: Mapping[str, str], fit_world: bool,
                resume_batch: int | None, notes: list[str]) -> BatchTriple | None:
    written = {m: said[f"batch.{m}"] for m in MEMBERS
               if f"batch.{m}" in said and sources.get(f"batch.{m}") != "--set"}  # what the JSON decides
    nowhere = holds_nowhere(*(written.get(m) for m in MEMBERS))
    if nowhere:  # no world size fits it: refused, as DeepSpeed refuses it, never fitted
        raise LintError([nowhere])
    known: dict[str, tuple[int, int]] = {}
    for member in MEMBERS:
        field, value = f"batch.{member}", getattr(run.batch, member)
        if sources.get(field) == "--set" and value is not None:
            known[member] = (value, SET)
        elif field in said:
            known[member] = (said[field], SET if not fit_world else JSON)
        elif value is not None:
            known[member] = (value, CONFIG)
    if world_size is None:
        if len(known) == 3 and all(isinstance(v, int) for v, _ in known.values()):
            return None  # lint without a world size: the triple is checked as written
        raise LintError(['batch sizes that are "auto" or missing need the world size; pass --world-size N'])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v, _ in known.values()):
        return None  # a mistyped batch size: the lint names it
    dp = Topology.of_run(run.parallel, run.pipeline.stages, world_size).check().data
    given = {m: v for m, (v, strength) in known.items() if sources.get(f"batch.{m}") == "--set"}
    if len(given) == 3 and given["global_batch"] != given["micro_batch"] * given["grad_accum"] * dp:
        shown = ", ".join(f"batch.{m}={v}" for m, v in given.items())
        raise LintError([f"--set {shown}: {given['global_batch']} != micro {given['micro_batch']} x accum "
                         f"{given['grad_accum']} x data-parallel {dp}; give only two of the three and bigtrain "
                         "derives the third"])
    triple = fit_batch(known, dp, resume_batch, sources, notes)
    if resume_batch is None and any(getattr(triple, m) != v for m, v in written.items()):
        notes.append(_fitted_line(written, triple, given))
    return triple


def _fitted_line(written: dict[str, int], triple: BatchTriple, given: dict[str, int]) -> str:
    """One line for a JSON batch fitted to this job: what it said, why it changed (the world size, or batch
    sizes given with --set), what trains."""
    said = ", ".join(f"{BATCH_FIELDS['batch.' + k]} {v}" for k, v in written.items())
    if given:
        why = "to hold " + ", ".join(f"--set batch.{m}={v}" for m, v in given.items())
    elif len(written) == 3:
        g, m, a = (written[k] for k in MEMBERS)
        why = f"was {g // (m * a)}"
    else:
        why = "the JSON's values do not hold there"
    g = written.get("global_batch")
    kept = ("" if g is None and "global_batch" in given else "; derived the global batch" if g is None
            else "; kept the global batch" if g == triple.global_batch else f"; global batch {g} -> {triple.global_batch}")
    return f"batch triple for data-parallel size {triple.dp_size} ({why}): {triple}; the JSON says {said}{kept}"


def fit_batch(known: dict[str, tuple[int, int]], dp: int, resume_batch: int | None, sources: Mapping[str, str],
           notes: list[str]) -> BatchTriple:
    """The triple keeping the most, and the most strongly held, of the given members; on resume the
    checkpoint's global batch is held unless batch.global_batch is given, and one line says so."""
    saved = resume_batch if isinstance(resume_batch, int) and resume_batch > 0 else None
    if saved is not None and "batch.global_batch" not in sources:
        known = {**known, "global_batch": (saved, CHECKPOINT)}
    triple = _best_triple(known, dp)
    if saved is not None:
        notes.append(_resume_line(saved, triple, sources))
    return triple


def _best_triple(known: dict[str, tuple[int, int]], dp: int) -> BatchTriple:
    must = [m for m, (_, rank) in known.items() if rank == SET]
    optional = [m for m in MEMBERS if m in known and m not in must]
    candidates = []
    for size in range(len(optional), -1, -1):
        for kept in itertools.combinations(optional, size):
            strength = sum(known[m][1] for m in kept)
            order = [m not in kept for m in KEEP_FIRST]  # the micro-batch (memory), then the global batch
            candidates.append((-size, -strength, order, kept))
    first_error: ValueError | None = None
    for _, _, _, kept in sorted(candidates):
        values = {m: known[m][0] for m in (*must, *kept)}
        try:
            return solve_batch(values.get("global_batch"), values.get("micro_batch"), values.get("grad_accum"), dp)
        except ValueError as err:
            first_error = first_error or err
            if not optional:
                break
    assert first_error is not None
    raise first_error


def _resume_line(saved: int, triple: BatchTriple, sources: Mapping[str, str]) -> str:
    given = sources.get("batch.global_batch")
    if given:
        why = f"batch.global_batch given by {given}"
    elif triple.global_batch == saved:
        why = "kept"
    else:
        why = (f"{saved} is not a multiple of data-parallel {triple.dp_size} x any micro-batch, so it could not "
               "be kept; set batch.global_batch to choose")
    return (f"global batch: the checkpoint trained with {saved}, this job trains with {triple.global_batch} "
            f"({why}): {triple}")


def with_triple(run: RunConfig, triple: BatchTriple) -> RunConfig:
    from bigtrain.ds.mapping import with_fields  # mapping reads DeepSpeed's config models: imported when needed
    return with_fields(run, {"batch.global_batch": triple.global_batch, "batch.micro_batch": triple.micro_batch,
                             "batch.grad_accum": triple.grad_accum})


def triple_world(config: dict) -> int:
    """The data-parallel size a complete triple was written for (1 when it cannot tell)."""
    g, m, a = (config.get(k) for k in BATCH_KEYS)
    if all(isinstance(v, int) and v > 0 for v in (g, m, a)) and g % (m * a) == 0:
        return g // (m * a)
    return 1
