"""One topology (bigtrain.config.topology): its sizes, and the same rule worded for the run config, the
DeepSpeed-JSON lint and the estimator."""
from __future__ import annotations

import pytest

from bigtrain.config.load import load_run_config
from bigtrain.ds.lint import DeviceCaps, errors, lint_problems
from bigtrain.config.topology import DS_AXES, Topology

CPU = DeviceCaps("cpu", fp16=False, bf16=True, local=False)


def test_the_sizes_every_reader_asks_for():
    t = Topology(16, pipeline=2, tensor=2, expert=4)
    assert (t.stage, t.model_split, t.replica, t.data, t.zero_ranks, t.expert_data) == (8, 2, 4, 4, 4, 2)
    assert t.label() == "pp2+tp2+ep4+dp4"
    assert Topology(8, sequence=2).zero_ranks == 8 and Topology(8, sequence=2).data == 4
    assert Topology(4).label() == "dp4"


def test_of_reads_a_deepspeed_dict():
    ds = {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 1, "pipeline": {"stages": 1},
          "expert_parallel": {"enabled": True, "autoep_size": 2}}
    assert Topology.of(ds, 8) == Topology(8, tensor=2, expert=2)
    ds["expert_parallel"]["enabled"] = False  # DeepSpeed reads the size only when enabled
    assert Topology.of(ds, 8).expert == 1


@pytest.mark.parametrize("topology, said", [
    (Topology(6, tensor=4), "world size 6 is not divisible by parallel.tensor=4 = 4 ranks per model replica"),
    (Topology(4, pipeline=3), "world size 4 is not divisible by pipeline.stages=3"),
    (Topology(6, expert=4), "parallel.expert=4 does not divide the 6 ranks"),
    (Topology(4, pipeline=2, expert=2), "parallel.expert=2 with pipeline.stages=2"),
    (Topology(4, sequence=2, expert=2), "parallel.expert=2 with parallel.sequence=2"),
    (Topology(0), "must be >= 1"),
])
def test_impossible_splits_are_one_line_each(topology, said):
    with pytest.raises(ValueError, match=said.replace("+", r"\+")):
        topology.check()


def test_tensor_by_sequence_parallelism_splits_the_world_and_each_shards_heads():
    """TP x SP is a split (bigtrain.parallel.tensor_sequence): the world divides into tensor x sequence replicas,
    and Ulysses splits each tensor shard's heads, so their product divides the heads and the tensor size the
    key-value heads."""
    from bigtrain.models import build
    from bigtrain.parallel.split_rules import check_split
    topology = Topology(8, tensor=2, sequence=2)
    topology.check()
    assert (topology.data, topology.model_split, topology.zero_ranks) == (2, 4, 4)
    check_split(build("llama", "tiny"), Topology(4, tensor=2, sequence=2))  # 4 heads, 2 key-value heads
    with pytest.raises(ValueError, match="parallel.tensor=2 x parallel.sequence=4: the model's 4 attention heads"):
        check_split(build("llama", "tiny"), Topology(8, tensor=2, sequence=4))
    with pytest.raises(ValueError, match="key-value heads do not divide by parallel.tensor=4"):
        check_split(build("llama", "custom", n_layer=1, n_embd=64, n_head=8, n_kv_head=2), Topology(8, tensor=4,
                                                                                                sequence=2))


def test_the_run_config_the_lint_and_the_estimator_word_one_rule_alike():
    """The same combination, refused by each reader with the topology's sentence in its own vocabulary."""
    from bigtrain.estimate.memory_model import Setup
    run_line = Topology(0, sequence=2, expert=2).combination_problems()[0]
    with pytest.raises(ValueError) as err:
        load_run_config(None, ["parallel.sequence=2", "parallel.expert=2"])
    assert run_line in str(err.value)
    ds = {"train_batch_size": 4, "sequence_parallel_size": 2, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    lines = [str(p) for p in errors(lint_problems(ds, CPU, world_size=4))]
    assert Topology(4, sequence=2, expert=2).combination_problems(DS_AXES)[0] in lines, lines
    assert "sequence_parallel_size=2" in " ".join(lines) and "parallel.sequence" not in " ".join(lines)
    with pytest.raises(ValueError, match="not divisible by parallel.tensor=4"):
        Setup(world_size=6, tensor=4)


def test_a_world_the_split_does_not_divide_is_refused_before_the_batch_is_solved():
    from bigtrain.ds.generate import build_ds_config
    with pytest.raises(ValueError, match="world size 3 is not divisible by parallel.tensor=2"):
        build_ds_config(load_run_config(None, ["model.family=llama", "parallel.tensor=2"]), 3)
