"""The settings every objective that generates its answers shares (GRPO and RLOO, grpo.py; on-policy distillation,
distill.py): how a round's completions are sampled, TRL's GRPOConfig names and defaults, and what they may call
(`ToolSettings`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bigtrain.fields import doc
from bigtrain.objectives.base import check_positive
from bigtrain.objectives.tool_use import ToolSettings

GROUP_DOC = ("grpo/rloo/distill: completions sampled per prompt (a group); the global batch counts completions "
             "and holds whole groups on every rank.")


@dataclass(kw_only=True)
class GenerationSettings(ToolSettings):
    """How an online objective samples its completions (TRL's GRPOConfig names and defaults), and what they may
    call (`ToolSettings`)."""

    num_generations: int = doc(8, GROUP_DOC)
    max_completion_length: int = doc(512, "grpo/rloo/distill: the most tokens a completion has; prompts get "
                                          "data.seq_len minus this (longer ones cut or dropped: "
                                          "data.long_examples).")
    temperature: float = doc(1.0, "grpo/rloo/distill: the sampling temperature (also of the log-probabilities the "
                                  "loss uses).")
    top_p: float = doc(1.0, "grpo/rloo/distill: nucleus sampling's probability mass (1.0: off).")
    top_k: int = doc(0, "grpo/rloo/distill: sample among the k likeliest tokens (0: off).")
    decode: Literal["compact", "generate"] = doc(
        "compact", "grpo/rloo/distill: compact drops a completion that ended from the batch and the KV cache, so the "
        "rows still decoding pay for no finished one (the same completions as generate under the same seed until the "
        "first ends, the same distribution after); generate is transformers' generate, which decodes every row until "
        "the longest ends. With ZeRO-3 weights left partitioned every rank decodes max_completion_length steps.")
    ds3_gather_for_generation: Literal["auto"] | bool = doc(
        "auto", "grpo/rloo/distill at ZeRO-3: true gathers the weights once per round of generation (fast; the model "
        "must fit one device), false leaves them partitioned (one all-gather per layer and decode step); auto = "
        "true where the whole model takes at most half of each device's free memory.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "num_generations", "max_completion_length", "temperature")
        if not 0.0 < self.top_p <= 1.0 or self.top_k < 0:
            raise ValueError(f"objective.top_p={self.top_p} / objective.top_k={self.top_k}: top_p must be in (0, 1], "
                             "top_k >= 0 (0: off)")
