"""Tools a model calls while it generates (objective.tools, and the public methods of objective.environment's
environments), as TRL 1.16's GRPOTrainer takes them: plain Python functions, sync or async, with type hints and a
Google-style docstring, described to the chat template by transformers' `get_json_schema`.

    tools = load_tools(["tools.py:add", "mypackage.search:lookup"])    # [Tool]: name, function, JSON schema
    results = run_calls([[Call("add", {"a": 1, "b": 2})], []], [{t.name: t.fn for t in tools}] * 2, timeout=60.0)

`run_calls` runs one turn's calls: the rollouts side by side (async tools on the process's event loop, sync ones
each in a thread of its own), each rollout's own calls in order (they may share its environment), each call cut at
`timeout` seconds. Whatever goes wrong in a call is the tool's answer, never the run's end: a tool that raises, an
unknown name, arguments that are not an object of the tool's parameters, a call the parser could not read, a
timeout, each becomes `{'error': '...'}` (TRL's form) in the tool message and counts as a failure. A sync tool cut at
its timeout keeps running in its (daemon) thread until it returns; nothing waits for it, the process's exit included.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

# environment methods that are not tools (TRL's rule; names starting with "_" are private too)
NOT_TOOLS = ("reset", "get_reward")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name (what the model writes), the function, its JSON schema."""

    name: str
    fn: Callable
    schema: dict


@dataclass(frozen=True)
class Call:
    """One call a completion made: a tool's name and its arguments (as parsed); `error` when the call could not be
    read (its JSON broken, no name), which is then the tool's answer."""

    name: str
    arguments: Any
    error: str | None = None


@dataclass(frozen=True)
class Result:
    """A call's answer as the `tool` message's content, and whether the call failed."""

    name: str
    content: Any
    failed: bool

    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


def load_tools(specs: list[str], setting: str = "objective.tools") -> list[Tool]:
    """The functions `specs` name (path/to/file.py:function, package.module:function), each with its schema; one
    line naming the spec when one cannot be had, or two share a name."""
    from bigtrain.rollout.rewards import load_function
    tools = [tool_of(load_function(spec, setting), f"{setting} {spec!r}") for spec in specs]
    check_unique(tools, setting)
    return tools


def tool_of(fn: Callable, where: str) -> Tool:
    """`fn` as a tool: its JSON schema from transformers, or one line saying what it lacks."""
    from transformers.utils import get_json_schema
    if inspect.isclass(fn):
        raise ValueError(f"{where}: is a class; a tool is a function (a class with methods is an environment: "
                         "objective.environment)")
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 -- transformers' TypeHintParsingException / DocstringParsingException
        raise ValueError(f"{where}: {str(e).splitlines()[0]}; a tool needs a type hint on every argument and a "
                         "Google-style docstring (a description, then 'Args:' with a line for each argument), which "
                         "transformers' get_json_schema turns into what the model reads") from None
    return Tool(schema["function"]["name"], fn, schema)


def method_tools(owner: Any, where: str) -> list[Tool]:
    """The public methods of an environment (an instance, or its class: read without making one) as tools, bound
    to `owner` (for a class, to a stand-in: schemas only)."""
    cls = owner if inspect.isclass(owner) else type(owner)
    bound_to = object() if inspect.isclass(owner) else owner
    return [tool_of(types.MethodType(getattr(cls, name), bound_to), f"{where}: method {name!r}")
            for name in public_methods(cls)]


def public_methods(cls: type) -> list[str]:
    """The names of a class's methods that are tools (TRL's rule: not reset or get_reward, nothing private)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


def check_unique(tools: list[Tool], where: str) -> None:
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ValueError(f"{where}: two tools are named {tool.name!r}; the model calls a tool by its name, so "
                             "each needs its own")
        seen.add(tool.name)


def run_calls(calls: list[list[Call]], tools: list[dict[str, Callable]], timeout: float) -> list[list[Result]]:
    """Each rollout's calls (`calls[i]`, in order) with its tools (`tools[i]`: name -> function), every rollout's at
    once on the process's event loop (bigtrain.rollout.event_loop: an async tool's client, bound to its loop, lives
    on between turns, as TRL runs them); each call cut at `timeout` seconds. One Result per call, in the same
    places."""
    if not any(calls):
        return [[] for _ in calls]
    from bigtrain.rollout.event_loop import settle_all
    out = settle_all([_in_order(c, t, timeout) for c, t in zip(calls, tools)])
    for results in out:
        if isinstance(results, BaseException):  # a KeyboardInterrupt inside a tool: the user's stop, not its answer
            raise results
    return out


async def _in_order(calls: list[Call], tools: dict[str, Callable], timeout: float) -> list[Result]:
    return [await _one(call, tools, timeout) for call in calls]


async def _one(call: Call, tools: dict[str, Callable], timeout: float) -> Result:
    if call.error is not None:
        return _failed(call.name, call.error)
    fn = tools.get(call.name)
    if fn is None:
        return _failed(call.name, f"Tool {call.name} not found.")
    if not isinstance(call.arguments, dict):
        return _failed(call.name, f"the arguments of {call.name} must be a JSON object of its parameters, got "
                                  f"{type(call.arguments).__name__}")
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(**call.arguments), timeout)
        else:
            value = await asyncio.wait_for(_in_thread(fn, call.arguments), timeout)
        if inspect.isawaitable(value):  # a sync function that returned a coroutine
            value = await asyncio.wait_for(value, timeout)
    except asyncio.TimeoutError:
        return _failed(call.name, f"{call.name} did not answer within {timeout:g} s")
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- whatever the user's tool raises is its answer
        return _failed(call.name, str(e) or type(e).__name__)
    return Result(call.name, value if isinstance(value, list) else str(value), False)


def _failed(name: str, error: str) -> Result:
    return Result(name, str({"error": error}), True)


def _in_thread(fn: Callable, kwargs: dict) -> asyncio.Future:
    """fn(**kwargs) in a daemon thread of its own, as a future of this loop: a call cut at its timeout is left
    running there, and nothing (the process's exit included) waits for it, as a thread pool's workers would be."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def work() -> None:
        try:
            value, error = fn(**kwargs), None
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting call (SystemExit as an error too)
            value, error = None, e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}")
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is closed (the process ends): the answer came too late
            pass

    threading.Thread(target=work, daemon=True, name=f"tool {getattr(fn, '__name__', 'call')}").start()
    return future
