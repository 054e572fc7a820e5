"""Tool use in online RL: the settings every objective that generates shares (`GenerationSettings` extends
`ToolSettings`), with TRL 1.16's meanings (GRPOTrainer's `tools`, `environment_factory`,
`max_tool_calling_iterations`). What they do is bigtrain.rollout's: tools.py and environments.py load and call
them, tool_format.py reads the calls and renders the results, agent.py runs the turns (every rank in lockstep).
"""
from __future__ import annotations

from dataclasses import dataclass

from bigtrain.fields import doc

ENVIRONMENT_FORMS = ("path/to/file.py:Class, package.module:Class, or several as [name=file.py:Class, ...] (a YAML "
                     "mapping name: file.py:Class too)")


@dataclass(kw_only=True)
class ToolSettings:
    """What a rollout may call while it generates, and the environments it acts in."""

    tools: str | list[str] | None = doc(
        None, "grpo/rloo/distill: functions the model may call while it answers: path/to/file.py:function or "
              "package.module:function (one, or a list), sync or async, each with type hints and a Google-style "
              "docstring (its JSON schema reaches the chat template as tools=); each call's result is appended as a "
              "tool message and the rollout goes on from it, the results out of the loss.")
    environment: str | list[str] | dict[str, str] | None = doc(
        None, "grpo/rloo/distill: what each rollout acts in: path/to/file.py:Class (or a factory), one instance per "
              "rollout, reset(**record) before it (a returned text is appended to the prompt), its public methods "
              "the rollout's tools, its get_reward() an extra reward named after the class; several as "
              "[name=file.py:Class, ...], chosen by each record's 'environment' column. Without --data the "
              "environment's reset makes each prompt (train.steps then sets the run's length).")
    max_tool_calling_iterations: int | None = doc(
        None, "grpo/rloo/distill: the most rounds of tool calls in a rollout (None: no limit; a rollout also ends "
              "at a turn that calls nothing, and at max_completion_length: a round of results that would pass it is "
              "dropped and the rollout ends there, as in TRL).")
    tool_timeout: float = doc(60.0, "grpo/rloo/distill: the seconds a tool call may take; a call cut there, like "
                                    "one that raises, answers the model with an error and counts as a failure.")

    def __post_init__(self) -> None:
        if isinstance(self.tools, str):
            self.tools = [self.tools]
        if self.tools is not None and not all(isinstance(t, str) and t.strip() for t in self.tools):
            raise ValueError(f"objective.tools={self.tools!r}: give path/to/file.py:function or "
                             "package.module:function (one, or a list)")
        self.environments  # noqa: B018 -- its form checked now, one line
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 1:
            raise ValueError(f"objective.max_tool_calling_iterations={self.max_tool_calling_iterations}: must be >= 1 "
                             "(or null: no limit)")
        if not self.tool_timeout > 0:
            raise ValueError(f"objective.tool_timeout={self.tool_timeout}: must be > 0 seconds")

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) or self.environment is not None

    @property
    def environments(self) -> dict[str | None, str] | None:
        """objective.environment as {None: spec} (one environment) or {name: spec} (chosen per record); None if
        unset."""
        given = self.environment
        if given is None:
            return None
        if isinstance(given, dict):
            named = {str(k): v for k, v in given.items()}
        else:
            items = [given] if isinstance(given, str) else list(given)
            if len(items) == 1 and isinstance(items[0], str) and "=" not in items[0]:
                return {None: items[0].strip()}
            named = {}
            for item in items:
                name, sep, spec = item.partition("=") if isinstance(item, str) else ("", "", "")
                if not sep or not name.strip() or name.strip() in named:
                    raise ValueError(f"objective.environment={given!r}: give one {ENVIRONMENT_FORMS}; each of several "
                                     "needs its own name")
                named[name.strip()] = spec
        if not named or not all(isinstance(v, str) and v.strip() for v in named.values()):
            raise ValueError(f"objective.environment={given!r}: give {ENVIRONMENT_FORMS}")
        return {k: v.strip() for k, v in named.items()}
