"""Online RL's collapse, flagged: every group of every round in a logging window answered alike, its completions the
same tokens or its rewards all equal (TRL's frac_reward_zero_std at 1 at every step), so that every advantage is 0
and the policy learns nothing more. One warning line at the window's log step says so and names the likely causes,
as the diverging-loss guard names a loss's (bigtrain.train.loop); it is said again only after a window without it.

`identical_groups` is each group's verdict on one rank; the objective gathers them over the ranks
(bigtrain.objectives.online), so every rank's `CollapseWatch` sees the same shares and says the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


def identical_groups(completion_ids: torch.Tensor, completion_mask: torch.Tensor, group: int) -> torch.Tensor | None:
    """[G] 1.0 where every completion of the group (rows g * group ...) is the same tokens, else 0.0; None for groups
    of one completion, which are alike by themselves."""
    if group < 2:
        return None
    ids = (completion_ids * completion_mask).view(-1, group, completion_ids.shape[-1])
    return (ids == ids[:, :1]).all(-1).all(-1).float()


@dataclass
class CollapseWatch:
    """Each training step's shares (of groups whose completions were the same tokens, and whose rewards were all
    equal), until the next log step asks for its line."""

    temperature: float
    identical: float | None = None  # the current round's share of groups answered by one completion, over the ranks
    window: list[tuple[int, float | None, float | None]] = field(default_factory=list)  # (step, identical, zero std)
    said: bool = False  # the collapse was said and has lasted since

    def see(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, group: int,
            gather_rows: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        """A training round's completions (this rank's, in groups): the share of groups answered by one completion,
        over every rank (`gather_rows`: [n, k] of every rank)."""
        same = identical_groups(completion_ids, completion_mask, group)
        self.identical = None if same is None else float(gather_rows(same.unsqueeze(1), same.device).mean())

    def step(self, step: int, zero_std: float | None) -> None:
        """One training step on the current round; `zero_std`: its frac_reward_zero_std (None: no rewards)."""
        self.window.append((step, self.identical, zero_std))

    def line(self) -> str | None:
        """The warning for the steps since the last call, when every one of them collapsed and the last window did
        not; None otherwise."""
        window, self.window = self.window, []
        if not window:
            return None
        same = all(identical is not None and identical >= 1.0 for _, identical, _ in window)
        flat = all(zero_std is not None and zero_std >= 1.0 for _, _, zero_std in window)
        if not (same or flat):
            self.said = False
            return None
        if self.said:
            return None
        self.said = True
        steps = f"step {window[0][0]}" if len(window) == 1 else f"steps {window[0][0]}-{window[-1][0]}"
        what = ("the completions of every group were the same tokens" if same else
                "every group's completions got equal rewards (frac_reward_zero_std 1)")
        rewards = "" if same else ", or rewards that cannot tell the completions apart"
        return (f"{steps}: {what} at every step since the last log line, so every advantage is 0 and the policy learns "
                "nothing from them; unless every answer is already right (the task solved), the policy has collapsed "
                "to one answer per prompt: a learning rate too high (lower optimizer.lr) or a temperature too low "
                f"(objective.temperature={self.temperature:g}: raise it) are the usual causes{rewards}")
