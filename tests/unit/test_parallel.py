"""bigtrain.parallel in one process: topology checks, activation checkpointing from outside the model, the
pipeline layer specs (the pipeline form under DeepSpeed on 2 ranks and GPT-2 built inside zero.Init:
tests/dist/test_parallel_ranks.py)."""
from __future__ import annotations

import copy

import pytest
import torch

from bigtrain.models import build
from bigtrain.config.topology import check_topology
from bigtrain.parallel import apply_activation_checkpointing, to_pipeline_module
from bigtrain.parallel.pipeline import layer_specs


@pytest.mark.parametrize("args, message", [
    ((4, 3, 10), "world size 4 is not divisible by pipeline.stages=3"),
    ((4, 4, 3), "pipeline.stages=4 exceeds the model's 3 pipeline layers"),
    ((0, 1, 3), "must be >= 1"),
])
def test_check_topology_rejects_impossible_layouts(args, message):
    with pytest.raises(ValueError, match=message):
        check_topology(*args)


def test_check_topology_returns_data_parallel_size():
    assert check_topology(8, 2, 10) == 4
    assert check_topology(2, 1, 1) == 2


def test_pipeline_arguments_are_checked_before_building():
    spec = build("gpt2", "tiny", vocab_size=256)
    with pytest.raises(ValueError, match="partition_method='layers': use 'parameters', 'uniform' or 'type:REGEX'"):
        to_pipeline_module(spec, 2, partition_method="layers")
    with pytest.raises(ValueError, match="activation_checkpoint_interval=-1"):
        to_pipeline_module(spec, 2, activation_checkpoint_interval=-1)


def test_layer_specs_tie_embedding_and_head_and_start_from_the_plain_weights():
    spec = build("gpt2", "tiny", vocab_size=256)
    specs = layer_specs(spec, spec.layers(), seed=5)
    tied = [s for s in specs if hasattr(s, "key")]
    assert [s.key for s in tied] == ["wte", "wte"] and tied[0].forward_fn is None and tied[1].forward_fn is not None
    # Whichever stage builds a layer (the head's stage builds the tied embedding too), it holds the
    # weights the plain module has under the same names for the same seed.
    plain = spec.build(seed=5).state_dict()
    block, head = specs[2].build(), tied[1].build()
    assert all(torch.equal(t, plain[f"transformer.h.0.{n}"]) for n, t in block.state_dict().items())
    assert torch.equal(head.weight, plain["transformer.wte.weight"])


CHECKPOINT_CASES = [
    ("gpt2", {"vocab_size": 256, "dropout": 0.1, "n_layer": 4}, "deepspeed", 1, 4),
    ("gpt2", {"vocab_size": 256, "dropout": 0.1, "n_layer": 4}, "native", 1, 4),
    ("gpt2", {"vocab_size": 256, "dropout": 0.1, "n_layer": 4}, "auto", 2, 2),
    ("encoder", {"vocab_size": 256, "n_positions": 32, "dropout": 0.1}, "auto", 1, 2),
    ("resnet", {}, "deepspeed", 1, 4),
    ("resnet", {}, "auto", 3, 2),
]


@pytest.mark.parametrize("family, overrides, method, every_n, blocks", CHECKPOINT_CASES)
def test_activation_checkpointing_leaves_gradients_unchanged(family, overrides, method, every_n, blocks):
    """deepspeed.checkpointing unconfigured (its defaults) or HF's own, with dropout on."""
    spec = build(family, "tiny", **overrides)
    torch.manual_seed(0)
    plain = spec.build().train()
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(spec, wrapped, every_n=every_n, method=method) == blocks
    gen = torch.Generator().manual_seed(2)
    if spec.modality == "image":
        inputs, labels = torch.randn(2, 3, 32, 32, generator=gen), torch.tensor([3, 5])
    else:
        inputs = torch.randint(0, 256, (2, 16), generator=gen)
        labels = inputs if family == "gpt2" else torch.tensor([0, 1])
    results = []
    for module in (plain, wrapped):
        torch.manual_seed(1)  # same dropout masks
        loss = spec.loss(module(inputs), labels)
        loss.backward()
        results.append((loss.item(), dict(module.named_parameters()), dict(module.named_buffers())))
    (loss_a, params_a, bufs_a), (loss_b, params_b, bufs_b) = results
    assert loss_a > 0.1 and abs(loss_a - loss_b) <= 1e-6
    for name, p in params_a.items():
        torch.testing.assert_close(params_b[name].grad, p.grad, rtol=0, atol=1e-6, msg=name)
    for name, buf in bufs_a.items():  # BatchNorm stats moved once, not again in the recompute
        assert torch.equal(bufs_b[name], buf), name
    assert set(wrapped.state_dict()) == set(plain.state_dict())


def test_activation_checkpointing_bad_arguments():
    spec = build("resnet", "tiny")
    with pytest.raises(ValueError, match="resnet has no native activation checkpointing"):
        apply_activation_checkpointing(spec, spec.build(), method="native")
    with pytest.raises(ValueError, match="method='fast': use one of auto, native, deepspeed"):
        apply_activation_checkpointing(spec, spec.build(), method="fast")
    with pytest.raises(ValueError, match="every_n=0"):
        apply_activation_checkpointing(spec, spec.build(), every_n=0)


@pytest.mark.parametrize("packed", [False, True])
def test_a_sequence_rank_gets_its_slice_of_inputs_positions_and_targets(packed):
    """Sequence parallelism's slices (bigtrain.parallel.sequence.shard_sequence), joined, are the whole row's inputs,
    positions and next-token targets (`lm_targets`), for labels equal to the inputs and for packed blocks of
    seq_len + 1 labels; each rank makes its slice only (no whole-row positions or targets)."""
    from bigtrain.models.losses import lm_targets
    from bigtrain.parallel.sequence import shard_sequence
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 16), generator=generator)
    labels = torch.randint(0, 50, (2, 17), generator=generator) if packed else ids.clone()
    labels[0, 3] = -100
    restarting = torch.tensor([list(range(6)) + list(range(10))] * 2)
    for size in (1, 2, 4):
        for positions in (None, restarting):
            given = ids if positions is None else {"input_ids": ids, "position_ids": positions}
            parts = [shard_sequence(given, labels, size, rank) for rank in range(size)]
            assert all(t.shape == (2, 16 // size) for _, t in parts)
            assert torch.equal(torch.cat([t for _, t in parts], -1), lm_targets(labels, 16))
            assert torch.equal(torch.cat([i["input_ids"] for i, _ in parts], -1), ids)
            whole = torch.arange(16).expand(2, 16) if positions is None else positions
            assert torch.equal(torch.cat([i["position_ids"] for i, _ in parts], -1), whole)
