"""`RankSplitLM`: lm-eval's own HFLM around an in-memory module, its forward passes split over the ranks.

HFLM given a module assumes one process (rank 0 of 1). lm-eval's own multi-process mode splits the *documents*
over ranks (each rank builds every N-th document's requests) and batches each rank's share apart: the batches then
hold other requests than in one process, their padding differs, and fp32 logits differ in the last bits (measured:
perplexities 4e-8 apart); the gathered metrics are also summed in another order. bigtrain splits the *batches*
instead: every rank builds all requests (cheap: tokenizing), plans HFLM's own batches exactly as one process would,
runs every N-th batch, and the answers are all-gathered. Each request is then computed in the very batch one
process puts it in, so N ranks give bit for bit what one gives, and lm-eval's evaluator (world 1 on every rank)
aggregates them in one process's order.

- loglikelihood (multiple choice, single continuations): the requests of this rank's batches go through HFLM's
  `_loglikelihood_tokens`, which batches them again the same way (whole batches of the same sort order; its
  one-token-continuation groups kept whole).
- loglikelihood_rolling (perplexity) and generate_until: HFLM loops over batches itself, so these run twice: first
  each rank computes every N-th batch (the other ranks' batches return placeholders), the results are gathered,
  then the loop runs again replaying them. Only the first pass runs the model.

`split=False` is for a model whose ranks must all take part in every forward pass (ZeRO-3 partitions gathered
layer by layer during training): each rank then computes everything, in lockstep.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from bigtrain.eval.harness import require_lm_eval
from bigtrain.eval.tasks import quiet_lm_eval

require_lm_eval()
from lm_eval.models.huggingface import HFLM  # noqa: E402  (after the one-line check above)
from lm_eval.models.utils import Collator  # noqa: E402


class RankSplitLM(HFLM):
    """HFLM on `model` (a transformers causal LM, on this process's device) and `tokenizer`; with `world` > 1 and
    `split`, every rank takes its share of the forward passes and all ranks end with every answer."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, batch_size: int = 8, *, rank: int = 0, world: int = 1,
                 split: bool = True, progress: bool = True, max_length: int | None = None) -> None:
        with quiet_lm_eval():  # its warning that a module passed in means one process: the split below is ours
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        self.split_rank, self.split_world = rank, world
        self.splitting = split and world > 1
        self.progress = progress
        self._calls: _CallSplit | None = None  # set while a two-pass loop runs
        self.requests_seen: dict[str, int] = {}  # requests by type, for requests/s

    # -- lm-eval's request types ---------------------------------------------------------------------------------

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._count("loglikelihood", requests)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        self._count("loglikelihood_rolling", requests)
        quiet = disable_tqdm or not self.progress
        if not self.splitting:
            return super().loglikelihood_rolling(requests, disable_tqdm=quiet)
        return self._two_passes(lambda: super(RankSplitLM, self).loglikelihood_rolling(requests, disable_tqdm=quiet))

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        self._count("generate_until", requests)
        quiet = disable_tqdm or not self.progress
        if not self.splitting:
            return super().generate_until(requests, disable_tqdm=quiet)
        return self._two_passes(lambda: super(RankSplitLM, self).generate_until(requests, disable_tqdm=quiet))

    def _count(self, kind: str, requests: list) -> None:
        self.requests_seen[kind] = self.requests_seen.get(kind, 0) + len(requests)

    # -- where the model runs ------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        quiet = disable_tqdm or not self.progress or self._calls is not None or self.split_rank != 0
        run = lambda reqs: super(RankSplitLM, self)._loglikelihood_tokens(reqs, quiet, override_bs)  # noqa: E731
        if self._calls is not None:  # one batch of a rolling loop: this rank's, or a placeholder
            return self._calls.call(lambda: run(requests), lambda: [(0.0, False)] * len(requests))
        if not self.splitting:
            return run(requests)
        mine = self._my_requests(requests, override_bs)
        answers = run([requests[i] for i in mine])
        return _gather_in_order(len(requests), mine, answers)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **kwargs: Any) -> torch.Tensor:
        if self._calls is None:
            return super()._model_generate(context, max_length, stop, **kwargs)
        return self._calls.call(lambda: super(RankSplitLM, self)._model_generate(context, max_length, stop, **kwargs)
                                .cpu(), lambda: context)  # a placeholder: no generated tokens

    # -- the split -------------------------------------------------------------------------------------------------

    def _my_requests(self, requests: list, override_bs: int | None) -> list[int]:
        """Indices of the requests in this rank's batches of HFLM's plan (every `world`-th batch), in their order.

        The plan is HFLM's own: lm-eval's Collator over the same sort key (longest first, then the tokens) and, for
        a causal model with its logits cache, the same groups (context + continuation[:-1]: one forward pass scores
        several one-token continuations). A group is never split, so HFLM batches this rank's share into the very
        batches of the plan."""
        size = self.batch_size if self.batch_size != "auto" else override_bs
        if not isinstance(size, int):
            raise ValueError("--batch-size auto cannot be split over ranks (each would pick its own size); give a "
                             "number")
        grouped = self.backend == "causal" and self.logits_cache
        numbered = [_Numbered(request, index) for index, request in enumerate(requests)]
        plan = Collator(numbered, sort_fn=_sort_key, group_fn=_group_key, group_by="contexts" if grouped else None)
        members: dict[tuple, list[int]] = {}
        if grouped:
            for request in numbered:
                members.setdefault(tuple(_group_key(request)), []).append(request.number)
        mine: list[int] = []
        for number, batch in enumerate(plan.get_batched(n=size)):
            if number % self.split_world != self.split_rank:
                continue
            for request in batch:
                mine.extend(members[tuple(_group_key(request))] if grouped else [request.number])
        return sorted(mine)

    def _two_passes(self, loop: Callable[[], list]) -> list:
        """Run `loop` (an HFLM method that calls the model batch by batch) with each rank computing its batches,
        gather every rank's results, and run it again replaying them."""
        self._calls = _CallSplit(self.split_rank, self.split_world)
        try:
            loop()
            self._calls.gather()
            return loop()
        finally:
            self._calls = None


class _CallSplit:
    """Numbered calls of one loop: in the first pass call k runs on rank k % world (the others get a placeholder);
    after `gather` every rank holds every call's result, and the second pass returns them in order."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.results: dict[int, Any] = {}
        self.count = 0
        self.replaying = False

    def call(self, compute: Callable[[], Any], placeholder: Callable[[], Any]) -> Any:
        number, self.count = self.count, self.count + 1
        if self.replaying:
            return self.results[number]
        if number % self.world != self.rank:
            return placeholder()
        self.results[number] = compute()
        return self.results[number]

    def gather(self) -> None:
        everyone: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(everyone, self.results)
        for part in everyone:
            self.results.update(part)
        assert len(self.results) == self.count, f"{len(self.results)} results gathered for {self.count} calls"
        self.count, self.replaying = 0, True


class _Numbered(tuple):
    """A request tuple (the same contents, so the same sort and group keys) that knows its place in the list."""

    def __new__(cls, request: tuple, number: int) -> "_Numbered":
        made = super().__new__(cls, request)
        made.number = number
        return made


def _sort_key(request: tuple) -> tuple:
    """HFLM's `_collate`: longest context + continuation first, then by the tokens."""
    tokens = request[1] + request[2]
    return -len(tokens), tuple(tokens)


def _group_key(request: tuple) -> list:
    """HFLM's `_lookup_one_token_cont`: requests sharing context + continuation[:-1] share one forward pass."""
    return request[-2] + request[-1][:-1]


def _gather_in_order(total: int, mine: list[int], answers: list) -> list:
    """Every rank's answers (for the request indices `mine`) all-gathered into one list in request order."""
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, list(zip(mine, answers)))
    out: list = [None] * total
    for part in everyone:
        for index, answer in part:
            out[index] = answer
    missing = sum(a is None for a in out)
    assert not missing, f"{missing} of {total} requests were on no rank's batches"
    return out
