"""What a rollout may call, and the environments it acts in (objective.tools, objective.environment), as TRL 1.16's
GRPOTrainer takes `tools` and `environment_factory`.

    objective.environment=envs.py:Wordle                          one environment for every record
    objective.environment=[math=envs.py:Math, game=envs.py:Game]  (or a YAML mapping) one per record, named by its
                                                                  `environment` column; only its tools in its prompt

An environment is a class (or a factory: any callable taking no argument) whose instances have `reset(**record)`:
each rollout gets an instance of its own, made once and reset for later rounds (TRL's pool: "construct once, reset
often"). Before generation `reset` gets the record's columns (less `environment` where several are named); a string
it returns is appended to the last user message. The instance's public methods are the rollout's tools beside
objective.tools (not `reset`, not `get_reward`, no name starting with "_"), and `get_reward()` (sync or async),
where the class has one, scores the finished rollout: an extra reward of weight 1 named after the class, None for
rollouts of other environments. Reward functions get the rollouts' instances as `environments=`.

Every mistake here is one line before a rank needs to start (bigtrain.train.precheck calls `Toolbox`): a file that
does not import, a tool without type hints or docstring, an environment without `reset`, a record naming no
environment (`check_records`, on the first records there; on every batch on the ranks).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from bigtrain.rollout.tools import Tool, check_unique, load_tools, method_tools, public_methods

PLACEHOLDER_PROMPT = [{"role": "user", "content": ""}]  # the prompt of an environment's own records (TRL's)


class Toolbox:
    """objective.tools and objective.environment, loaded (`tools`: specs; `environments`: {None: spec} for one
    environment, {name: spec} for several, None for none). `names`: the settings' names the lines say (bigtrain
    chat's flags)."""

    def __init__(self, tools: list[str], environments: dict[str | None, str] | None,
                 names: tuple[str, str] = ("objective.tools", "objective.environment")):
        from bigtrain.rollout.rewards import load_function
        self.names = names
        self.tools = load_tools(tools, names[0])
        self.specs = environments or {}
        self.named = bool(self.specs) and None not in self.specs
        self.factories: dict[str | None, Callable] = {}
        self.methods: dict[str | None, list[Tool]] = {}
        self.pool: dict[str | None, list[Any]] = {}
        for name, spec in self.specs.items():
            where = self._where(name)
            same = next((n for n in self.factories if self.specs[n] == spec), False)  # one class, under two names
            factory = self.factories[same] if same is not False else \
                load_function(spec, names[1] if name is None else f"{names[1]} {name}")
            self.factories[name] = factory
            probe = factory if inspect.isclass(factory) else _made(factory, where)
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"{where}: {_kind(probe)} has no reset method; an environment needs reset(**record) "
                                 "(called before each rollout with the record's columns; it may return text to "
                                 "append to the prompt)")
            self.methods[name] = method_tools(probe, where)
            check_unique(self.tools + self.methods[name], where)
            self.pool[name] = [] if inspect.isclass(probe) else [probe]
        if not self.tools and not any(self.methods.values()):
            raise ValueError(f"{' / '.join(names)}: no tool to call (no function named, and the environments have no "
                             "public method); give the model something to call")

    def environment_of(self, record: dict, where: str = "a record") -> str | None:
        """The environment a record's rollouts act in (its `environment` column where several are named); one line
        when it names none of them."""
        if not self.named:
            return None
        name = record.get("environment") if isinstance(record, dict) else None
        if name not in self.specs:
            given = "has no 'environment'" if name is None else f"names environment={name!r}"
            raise ValueError(f"{where} {given}, which is not among {self.names[1]}'s "
                             f"({', '.join(map(str, self.specs))}); give each record the name of its environment in "
                             "an 'environment' column")
        return name

    def check_records(self, records: list[dict], where: str = "a record") -> None:
        for i, record in enumerate(records):
            self.environment_of(record, f"{where} {i + 1}" if len(records) > 1 else where)

    def schemas(self, record: dict) -> list[dict]:
        """What the prompt of a record's rollouts shows: objective.tools and its environment's methods."""
        extra = self.methods[self.environment_of(record)] if self.specs else []
        return [t.schema for t in self.tools + extra]

    def instances(self, records: list[dict]) -> list[Any]:
        """One environment instance per rollout (`records[i]` is rollout i's), from the pool, made where it has
        too few; None for each where no environment is set."""
        if not self.specs:
            return [None] * len(records)
        handed: dict[str | None, int] = {}
        out = []
        for record in records:
            name = self.environment_of(record)
            pool, index = self.pool[name], handed.get(name, 0)
            if index == len(pool):
                pool.append(_made(self.factories[name], self._where(name)))
            handed[name] = index + 1
            out.append(pool[index])
        return out

    def reset(self, instance: Any, record: dict) -> Any:
        """The instance reset for `record` (its columns, less `environment` where several are named): what it
        returned (text to append to the prompt, or None)."""
        columns = {k: v for k, v in record.items() if k != "environment"} if self.named else dict(record)
        return instance.reset(**columns)

    def callables(self, instance: Any) -> dict[str, Callable]:
        """What a rollout may call: objective.tools and its instance's methods, by name."""
        out = {t.name: t.fn for t in self.tools}
        if instance is not None:
            out.update({name: getattr(instance, name) for name in public_methods(type(instance))})
        return out

    def _where(self, name: str | None) -> str:
        spec = self.specs[name]
        return f"{self.names[1]} {spec!r}" if name is None else f"{self.names[1]} {name}={spec}"

    def reward_functions(self) -> list[tuple[str, Callable, str]]:
        """(name, reward function, spec) of each environment class with a get_reward (several names may share a
        class: once): an extra reward called with `environments=`, scoring that class's rollouts (None for others)."""
        out, seen = [], set()
        for name, factory in self.factories.items():
            cls = factory if inspect.isclass(factory) else type(self.pool[name][0])
            if cls not in seen and callable(getattr(cls, "get_reward", None)):
                seen.add(cls)
                out.append((cls.__name__, _environment_reward(cls), self.specs[name]))
        return out


def with_observation(prompt: list[dict], observation: Any) -> list[dict]:
    """The prompt with what an environment's reset returned appended to its last message (a copy)."""
    if observation is None:
        return prompt
    last = prompt[-1]
    content = last.get("content") or ""
    if isinstance(content, list):  # a message of content parts
        added = observation if isinstance(observation, list) else [{"type": "text", "text": str(observation)}]
        return [*prompt[:-1], {**last, "content": content + added}]
    return [*prompt[:-1], {**last, "content": content + str(observation)}]


def _environment_reward(cls: type) -> Callable:
    if inspect.iscoroutinefunction(cls.get_reward):
        async def scored(environments: list, **kwargs: Any) -> list:
            return [await e.get_reward() if type(e) is cls else None for e in environments]
    else:
        def scored(environments: list, **kwargs: Any) -> list:
            return [e.get_reward() if type(e) is cls else None for e in environments]
    scored.__name__ = cls.__name__
    return scored


def _made(factory: Callable, where: str) -> Any:
    try:
        return factory()
    except Exception as e:  # noqa: BLE001 -- the user's constructor: one line naming it
        raise ValueError(f"{where}: making an instance raised {type(e).__name__}: {e} (an environment is made with "
                         "no argument; the record's columns come to reset)") from None


def _kind(thing: Any) -> str:
    return f"class {thing.__name__}" if inspect.isclass(thing) else f"its instance ({type(thing).__name__})"
