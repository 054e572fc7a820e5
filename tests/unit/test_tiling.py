"""ALST's tiled MLP (bigtrain.parallel.tiling, DeepSpeed's TiledMLP) against the plain computation, its rule, and
the estimator's count of it."""
from __future__ import annotations

import copy

import pytest
import torch

from bigtrain.config.load import load_run_config
from bigtrain.config.rules import tiled_mlp_wanted
from bigtrain.models import build
from bigtrain.parallel.tiling import apply_tiled_mlp, apply_tiling, mlp_modules


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_tiled_mlp_gives_the_plain_loss_and_gradients(family):
    spec = build(family, "tiny", vocab_size=128, seq_len=64)
    plain = spec.build(seed=0)
    tiled = copy.deepcopy(plain)
    assert apply_tiled_mlp(tiled, 16) == len(mlp_modules(plain)) > 0
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (plain, tiled):
        model.train()
        loss = spec.loss(model(ids), ids)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


def test_the_tiles_save_the_mlp_intermediates_for_backward():
    """What backward keeps of one MLP: its input only (the plain MLP also keeps gate, up and their product)."""
    spec = build("llama", "tiny", vocab_size=128, seq_len=64)
    model = spec.build(seed=0).train()
    mlp = mlp_modules(model)[0]
    x = torch.randn(1, 64, spec.config.hidden_size, requires_grad=True)

    def saved_bytes(module: torch.nn.Module) -> int:
        sizes = {}
        params = {p.untyped_storage()._cdata for p in module.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage()._cdata not in params:
                sizes[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        return sum(sizes.values())

    before = saved_bytes(mlp)
    apply_tiled_mlp(model, 16)
    assert saved_bytes(mlp) == x.numel() * 4 < before / 3


def test_auto_tiles_a_long_sequence_and_false_turns_it_off():
    assert tiled_mlp_wanted("auto", 4096, 1024) and not tiled_mlp_wanted("auto", 4095, 1024)
    assert not tiled_mlp_wanted(False, 10**6, 64) and tiled_mlp_wanted(True, 8, 64)
    spec = build("llama", "tiny", vocab_size=128, seq_len=64)
    assert apply_tiling(spec.build(seed=0), spec, "auto") == 0  # 64 tokens < 4 x the hidden size
    assert apply_tiling(spec.build(seed=0), spec, True) == len(mlp_modules(spec.build(seed=0)))
    with pytest.raises(ValueError, match="activation_checkpointing.tiled_mlp=true with pipeline.stages=2"):
        load_run_config(None, ["activation_checkpointing.tiled_mlp=true", "pipeline.stages=2"])


def test_the_estimator_counts_the_tiles():
    from bigtrain.estimate.memory_model import Setup, estimate
    from bigtrain.estimate.counting import measure_activations
    from bigtrain.estimate.shape import shape_from_spec
    spec = build("llama", "tiny", vocab_size=128, seq_len=512, n_positions=512)
    shape = shape_from_spec(spec, "fp32")
    plain, tiled = (estimate(shape, Setup(world_size=1, precision="fp32", tiled_mlp=t)) for t in (False, True))
    untiled, tiles = measure_activations(spec, torch.float32), measure_activations(spec, torch.float32, tile=64)
    # the blocks' MLPs and RMSNorms, and the final RMSNorm outside them (lean with the tiles, parallel/rms_norm.py)
    counted = untiled.blocks + untiled.outside - tiles.blocks - tiles.outside
    assert plain.activations - tiled.activations == pytest.approx(counted) and counted > 0
    assert tiles.outside < untiled.outside
    sp2 = estimate(shape, Setup(world_size=2, sequence=2, precision="fp32", tiled_mlp=True))
    assert sp2.activations < tiled.activations


def test_a_run_trains_alike_tiled_or_not(one_rank_group, tmp_path, monkeypatch):
    """The engine applies the tiling (activation_checkpointing.tiled_mlp=true): 3 steps' losses as untiled."""
    from launch import TINY

    import bigtrain.train.assemble as engine  # where the engine is assembled (tiling included)
    from bigtrain.distributed.world import World
    from bigtrain.config.flags import build_run_parser as build_parser, run_config_from_args
    from bigtrain.train.job import train
    tiled_counts = []

    def recording(*args, **kwargs):
        tiled_counts.append(apply_tiling(*args, **kwargs))
        return tiled_counts[-1]

    monkeypatch.setattr(engine, "apply_tiling", recording)
    losses = {}
    for tiled in ("false", "true"):
        args = build_parser().parse_args(["--out", str(tmp_path / tiled), *TINY, "--model", "llama", "--steps", "3",
                                          "--set", "train.eval_interval=0", "--set", "checkpoint.at_end=false",
                                          "--set", f"activation_checkpointing.tiled_mlp={tiled}"])
        losses[tiled] = train(run_config_from_args(args), World(0, 0, 1))["losses"]
    assert tiled_counts == [0, 2]  # off, then both MLPs of the tiny Llama tiled
    assert max(abs(a - b) / a for a, b in zip(losses["false"], losses["true"])) <= 1e-5


@pytest.mark.parametrize("sets, said", [
    (["activation_checkpointing.offload_hidden_states=true"], "set activation_checkpointing.enabled=true too"),
    (["activation_checkpointing.offload_hidden_states=true", "activation_checkpointing.enabled=true",
      "activation_checkpointing.partition_activations=true"], "DeepSpeed's partition_activations / cpu_checkpointing"),
    (["activation_checkpointing.offload_hidden_states=true", "activation_checkpointing.enabled=true",
      "pipeline.stages=2"], "offload_hidden_states=true with pipeline.stages=2"),
])
def test_offloading_hidden_states_is_refused_where_it_cannot_run(sets, said):
    with pytest.raises(ValueError, match=said):
        load_run_config(None, sets)


def test_auto_offloads_hidden_states_on_an_accelerator_for_long_sequences_only():
    from bigtrain.config.rules import offload_hidden_states_wanted
    assert offload_hidden_states_wanted("auto", "cuda", True, 4096, 1024)
    assert not offload_hidden_states_wanted("auto", "cpu", True, 4096, 1024)  # host memory is the device's
    assert not offload_hidden_states_wanted("auto", "cuda", False, 4096, 1024)  # nothing checkpointed
    assert not offload_hidden_states_wanted("auto", "cuda", True, 1024, 1024)
    assert offload_hidden_states_wanted(True, "cpu", True, 8, 64)


def test_the_estimator_moves_offloaded_hidden_states_to_the_host():
    from bigtrain.estimate.memory_model import Setup, estimate
    from bigtrain.estimate.shape import shape_from_spec
    shape = shape_from_spec(build("llama", "tiny", vocab_size=128, seq_len=256), "bf16")
    kept, moved = (estimate(shape, Setup(world_size=1, checkpointing=True, offload_hidden_states=o))
                   for o in (False, True))
    assert moved.activations < kept.activations and moved.host > kept.host
    assert kept.activations - moved.activations == pytest.approx(moved.host - kept.host)


def test_a_run_offloading_hidden_states_trains_alike(one_rank_group, tmp_path, monkeypatch):
    """activation_checkpointing.offload_hidden_states=true: transformers' checkpointing inside DeepSpeed's offload
    manager, which marks each checkpointed layer's input (on a CPU it keeps them where they are: host memory is the
    device's); the losses are those of DeepSpeed's checkpointing without it."""
    from launch import TINY

    import bigtrain.parallel.checkpointing as checkpointing
    from bigtrain.distributed.world import World
    from bigtrain.config.flags import build_run_parser as build_parser, run_config_from_args
    from bigtrain.train.job import train
    managers = []

    def recording(*args, **kwargs):
        managers.append(install(*args, **kwargs))
        return managers[-1]

    install = checkpointing.install_hidden_state_offload
    monkeypatch.setattr(checkpointing, "install_hidden_state_offload", recording)
    losses = {}
    for offload in ("false", "true"):
        args = build_parser().parse_args(["--out", str(tmp_path / offload), *TINY, "--model", "llama", "--steps", "3",
                                          "--set", "train.eval_interval=0", "--set", "checkpoint.at_end=false",
                                          "--set", "activation_checkpointing.enabled=true",
                                          "--set", f"activation_checkpointing.offload_hidden_states={offload}"])
        losses[offload] = train(run_config_from_args(args), World(0, 0, 1))["losses"]
    assert len(managers) == 1 and managers[0].stats.marked_tensors == 2  # the last forward: 2 checkpointed layers
    assert max(abs(a - b) / a for a, b in zip(losses["false"], losses["true"])) <= 1e-5
