"""Initial weights that depend on the seed and the parameter names only, never on the build path.

Why: the same model is built in several ways (a plain module; partitioned inside
`deepspeed.zero.Init`; as pipeline stages, each stage building some layers). If each way
drew its weights from the global RNG in its own order, ZeRO-3, offload and a pipeline would
start from other weights than ZeRO-0 and their loss curves could not be compared. Here every
module of the *plain* model is initialised by the family's own per-module rule (HF's
`_init_weights`, BERT's or torchvision's init) with the RNG seeded from (seed, the module's
name in the plain model), on CPU in fp32, and the global RNG stream is left untouched. A
pipeline layer maps its local names to plain names through its `param_map`, so it gets the
very same numbers.

Modules are visited children first (as transformers' `initialize_weights`), so a parent's rule
that re-initialises a child's weight (GPT-2's scaled residual projections) runs after the
child's own. A module whose own parameters were all initialised already (an output head tied
to the input embedding) is skipped, in every form alike.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, ContextManager, Iterator

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]
GatherFn = Callable[[list[nn.Parameter]], ContextManager]


def module_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the module called `name` in the plain model (stable across runs and machines)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def seed_from_global_rng() -> int:
    """A seed drawn from torch's global RNG: `torch.manual_seed(s); spec.build()` stays reproducible."""
    return int(torch.randint(0, 2 ** 31 - 1, (1,), device="cpu").item())


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


@contextlib.contextmanager
def _fp32_on_cpu(params: list[nn.Parameter]) -> Iterator[None]:
    """Run the init on fp32 CPU copies: the numbers then do not depend on the device or the dtype
    the parameters live in (a CUDA generator draws other numbers than the CPU one)."""
    moved = [(p, p.data) for p in params if p.device.type != "cpu" or p.dtype != torch.float32]
    for p, data in moved:
        p.data = data.detach().to("cpu", torch.float32)
    try:
        yield
    finally:
        for p, data in moved:
            data.copy_(p.data)
            p.data = data


def init_seeded(root: nn.Module, init_fn: InitFn, seed: int, plain_name: Callable[[str], str | None] = lambda n: n,
                gather: GatherFn | None = None, writer: bool = True, only: set[str] | None = None) -> int:
    """Initialise every module of `root` with `init_fn`, seeded by its plain-model name; returns how many.

    `plain_name(local_name)` maps a module's name inside `root` to its name in the plain model
    (None: the module has no counterpart; it must then hold no parameters). `gather(params)`
    (ZeRO-3) makes the partitioned parameters whole for the duration; only the `writer` rank
    computes, and the gather context spreads its values. `only`: initialise just these plain-model
    module names (and their submodules), e.g. the head a pretrained checkpoint lacked.
    """
    if any(p.device.type == "meta" for p in root.parameters()):
        return 0  # shapes only (memory estimates, parameter counts): nothing to draw
    done: set[int] = set()
    count = 0
    for local, module in _post_order(root):
        own = list(module.parameters(recurse=False))
        touched = own + [p for child in module.children() for p in child.parameters(recurse=False)]
        name = plain_name(local)
        if name is None:
            assert not own, f"module {local!r} holds parameters but maps to no name of the plain model"
            continue
        if only is not None and not any(name == o or name.startswith(f"{o}.") for o in only):
            continue
        if own and all(id(p) in done for p in own):
            continue  # a tied alias (e.g. lm_head sharing the embedding): initialised with its owner
        with (gather(touched) if gather and touched else contextlib.nullcontext()):
            if writer:
                with torch.random.fork_rng(devices=[]), torch.no_grad(), _fp32_on_cpu(touched):
                    torch.manual_seed(module_seed(seed, name))
                    init_fn(module)
        done.update(id(p) for p in own)
        count += 1
    return count


def layer_plain_name(param_map: dict[str, str]) -> Callable[[str], str | None]:
    """For a pipeline layer: local module name -> plain module name through the layer's `param_map`."""

    def name(local: str) -> str | None:
        key = f"{local}." if local else ""
        prefix = max((p for p in param_map if key.startswith(p)), key=len, default=None)
        if prefix is None:
            return None
        return (param_map[prefix] + key[len(prefix):]).rstrip(".")

    return name


@contextlib.contextmanager
def untouched_global_rng() -> Iterator[None]:
    """Construct modules without consuming the global RNG stream (their inits are replaced anyway)."""
    with torch.random.fork_rng(devices=[]):
        yield
