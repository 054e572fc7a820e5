"""Every byte a training step holds, tensor by tensor: the measurement the memory model's per-token terms come from.

`LiveBytes` watches the tensors a piece of work makes (a `TorchDispatchMode`: every aten op's outputs, forward,
backward and a checkpoint's recompute alike) and lets each storage go when the storage itself is freed (a weak
reference to it). Each storage is labelled with the module that made it (the innermost module whose
forward runs, or in backward the module whose output's gradient came last), the pass (forward, backward, or a forward run inside backward: a recompute), the
op, and whether autograd saved it for backward (`saved_tensors_hooks`). The peak of the live bytes and the storages
live at that moment are what a rank needs for this work; two sequence lengths give what one more token costs, by
label (`per_token`).

What it cannot see: storages made before it starts (parameters, optimizer states: constant in the sequence length),
and buffers a kernel allocates inside itself without an aten op (the allocator's count, `allocator_peak`, sees
those: torch.profiler's memory events report the CPU allocator's running total).
"""
from __future__ import annotations

import re
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_LAYER = re.compile(r"\.\d+(?=\.|$)")


@dataclass(frozen=True)
class Label:
    """What made a storage: `where` the module (its path below the root, layer numbers as *), `phase` forward |
    backward | recompute, `op` the aten op, `saved` whether autograd kept it for backward."""

    where: str
    phase: str
    op: str
    saved: bool = False


@dataclass
class Snapshot:
    """The peak of one piece of work: `peak` live bytes made inside it, and how they split by label."""

    peak: int
    live: dict[Label, int] = field(default_factory=dict)
    allocator_peak: int | None = None  # the CPU allocator's own count, where it was asked (torch.profiler)
    allocator_live: dict[str, int] = field(default_factory=dict)  # what it held then, by the op that allocated it
    resident: int = 0  # tensor bytes alive before the work (model states, buffers): the rank's peak is both

    @property
    def rank_peak(self) -> int:
        return self.resident + self.peak

    def by(self, key: Callable[[Label], Any]) -> dict[Any, int]:
        grouped: dict[Any, int] = defaultdict(int)
        for label, nbytes in self.live.items():
            grouped[key(label)] += nbytes
        return dict(grouped)

    def to_json(self) -> dict:
        return {"peak": self.peak, "allocator_peak": self.allocator_peak, "allocator_live": self.allocator_live,
                "resident": self.resident,
                "live": [[label.where, label.phase, label.op, label.saved, n] for label, n in self.live.items()]}

    @classmethod
    def from_json(cls, data: dict) -> "Snapshot":
        return cls(data["peak"], {Label(w, p, o, s): n for w, p, o, s, n in data["live"]}, data.get("allocator_peak"),
                   data.get("allocator_live", {}), data.get("resident", 0))


def module_path(fqn: str) -> str:
    """A module's path below the root as a row of the table: without the engine's wrappers, layers as *."""
    parts = fqn.split(".") if fqn else []
    while parts and parts[0] in ("module", "base_model", "model") and len(parts) > 1:
        parts = parts[1:]
    return _LAYER.sub(".*", "." + ".".join(parts))[1:] or "(outside modules)"


class LiveBytes(TorchDispatchMode):
    """A context manager: `with LiveBytes() as watch: step()`, then `watch.snapshot()` (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[int, Label] = {}  # record id -> label
        self.sizes: dict[int, int] = {}
        self.events: list[tuple[int, int]] = []  # (record id, +bytes | -bytes), in order
        self.refs: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (a weak reference to it, record id)
        self.names: dict[int, str] = {}  # id(module) -> its path below the first module called
        self.running: list[str] = []  # the modules whose forward runs, innermost last
        self.backward_in = "(outside modules)"  # the module whose output's gradient arrived last
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._handles: list[Any] = []
        self._next = 0

    # -- what the work makes -----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view, an in-place op or out= hands back a storage it was given: not a new one (a parameter's, say)
        given = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in given:
                self._track(t, str(func.overloadpacket.__name__))
        return out

    def _track(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        if id(storage) in self.refs or storage.nbytes() == 0:
            return
        record, self._next = self._next, self._next + 1
        self.labels[record] = Label(self._where(), self._phase(), op)
        self.sizes[record] = storage.nbytes()
        self.events.append((record, storage.nbytes()))
        key = id(storage)

        def freed(_: weakref.ref, record: int = record, key: int = key) -> None:
            self.events.append((record, -self.sizes[record]))
            self.refs.pop(key, None)

        self.refs[key] = (weakref.ref(storage, freed), record)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ref, record = self.refs.get(id(storage), (None, -1))
        if ref is not None and ref() is storage and not self.labels[record].saved:
            label = self.labels[record]
            self.labels[record] = Label(label.where, label.phase, label.op, True)
        return t

    def _where(self) -> str:
        if self.running:
            return self.running[-1]
        return self.backward_in if torch._C._current_autograd_node() is not None else "(outside modules)"

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() == -1:
            return "forward"
        return "recompute" if self.running else "backward"

    # -- which module runs: forward hooks on every module; in backward, the one whose output's gradient came last
    def _enter(self, module: nn.Module, args: Any) -> None:
        if id(module) not in self.names:
            if not self.running and not self.names:
                self.names.update({id(m): module_path(n) for n, m in module.named_modules()})
            self.names.setdefault(id(module), type(module).__name__)
        self.running.append(self.names[id(module)])

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.running.pop() if self.running else self.names.get(id(module), "?")
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, name=name: setattr(self, "backward_in", name))

    # -- the context ---------------------------------------------------------------------------------------------
    def __enter__(self) -> "LiveBytes":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        self._handles = [register_module_forward_pre_hook(self._enter),
                         register_module_forward_hook(self._leave, always_call=True)]
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    # -- what it saw ---------------------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The peak of the live bytes over the events so far, and the labels of what was live then."""
        live, peak, at = 0, 0, -1
        for i, (_, delta) in enumerate(self.events):
            live += delta
            if live > peak:
                peak, at = live, i
        alive: set[int] = set()
        for record, delta in self.events[:at + 1]:
            (alive.add if delta > 0 else alive.discard)(record)
        by_label: dict[Label, int] = defaultdict(int)
        for record in alive:
            by_label[self.labels[record]] += self.sizes[record]
        return Snapshot(peak, dict(by_label))


def peaks_around(events: list[tuple[int, int]], index: int) -> tuple[int, int]:
    """(the peak of the live bytes over `events` before `index`, the peak from `index` on)."""
    live, before, after = 0, 0, 0
    for i, (_, delta) in enumerate(events):
        live += delta
        if i < index:
            before = max(before, live)
        else:
            after = max(after, live)
    return before, after


def alive_storages(device: str = "cpu") -> list[torch.UntypedStorage]:
    """Every tensor storage alive now on `device`, once each."""
    import gc
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == device and not obj.is_meta:
                storage = obj.untyped_storage()
                found[id(storage)] = storage
        except (RuntimeError, ReferenceError):  # a tensor without storage (a subclass wrapper), a dead proxy
            continue
    return list(found.values())


def resident_bytes(device: str = "cpu", besides: weakref.WeakSet | None = None) -> int:
    """Bytes of every tensor storage alive now on `device` (the model, its gradients, the optimizer's states,
    DeepSpeed's buffers: whatever a step starts from), but those in `besides` (what was alive before a job began:
    an earlier job's leftovers in the same process)."""
    return sum(s.nbytes() for s in alive_storages(device) if besides is None or s not in besides)


def allocator_peak(work: Callable[[], Any]) -> tuple[Any, int, dict[str, int]]:
    """Run `work` under torch.profiler with memory profiling: (its result, the peak of the bytes the CPU allocator
    held for blocks made inside it, every buffer a kernel makes included, and what was live then by the op that
    allocated it). Blocks made before the profile began are not counted."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = work()
    events = sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree()))
    peak, at, _ = _replay(events)
    live = _replay(events[:at + 1])[2]
    by_op: dict[str, int] = defaultdict(int)
    for size, op in live.values():
        by_op[op] += size
    return result, peak, dict(by_op)


def _replay(events: list[tuple[int, int, int, str]]) -> tuple[int, int, dict[int, tuple[int, str]]]:
    """(peak bytes, the event it came at, the blocks live at the end: pointer -> (bytes, op))."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at = -1
    for i, (_, ptr, size, op) in enumerate(events):
        # A block freed on a thread the profiler does not watch (gloo's, which drops a collective's tensors) is
        # never reported freed, and the allocator's own total keeps it: it was free once its address comes back.
        total -= live.pop(ptr, (0, ""))[0]
        if size > 0:
            live[ptr] = (size, op)
            total += size
            if total > peak:
                peak, at = total, i
    return peak, at, live


def _allocations(events: list) -> Iterator[tuple[int, int, int, str]]:
    """(time, pointer, bytes (< 0: freed), the innermost op around it) of every CPU allocator event in a profile."""
    from torch._C._profiler import _EventType
    stack = list(events)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            yield event.start_time_ns, fields.ptr, fields.alloc_size, event.parent.name if event.parent else "-"


def per_token(short: Snapshot, long: Snapshot, tokens: int, key: Callable[[Label], Any] = lambda label: label
              ) -> dict[Any, float]:
    """Bytes per token by `key(label)`: what the peak at the longer sequence holds more than at the shorter one,
    over `tokens` more tokens (the two peaks may fall at different moments: each group is read at its own peak)."""
    a, b = short.by(key), long.by(key)
    return {k: (b.get(k, 0) - a.get(k, 0)) / tokens for k in sorted(set(a) | set(b), key=str)}
