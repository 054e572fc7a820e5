"""Rules of the split modes that hold whichever way a size is given: a DeepSpeed JSON's
tensor/sequence size is judged like --set's, the fast path never drops a mixture of experts' router loss, an
export by tag checks digests, and DeepSpeed's old `bfloat16` section name is read as bf16."""
from __future__ import annotations

import os

import pytest
import torch

from bigtrain.config.load import load_run_config
from bigtrain.parallel.split_rules import check_split_layout
from bigtrain.config.topology import Topology


@pytest.mark.parametrize("sets, topology, expected", [
    (["model.family=gpt2"], Topology(2, tensor=2), "gpt2 family does not support tensor"),
    (["model.family=llama", "lora.r=8"], Topology(2, tensor=2), "lora.r=8 with parallel.tensor=2"),
    (["model.family=llama", "data.seq_len=255"], Topology(2, sequence=2), "data.seq_len=255 is not divisible"),
    (["model.family=llama", "data.packing=true", "data.format=chat"], Topology(2, pipeline=2), "data.packing=true"),
    (["model.family=llama", "batch.micro_batch=auto"], Topology(2, tensor=2), "batch.micro_batch=auto"),
])
def test_sizes_from_a_deepspeed_json_meet_the_run_configs_rules(sets, topology, expected):
    with pytest.raises(ValueError, match=expected):
        check_split_layout(load_run_config(None, sets), topology)


def test_sizes_a_family_supports_pass():
    check_split_layout(load_run_config(None, ["model.family=llama"]), Topology(4, tensor=2))
    check_split_layout(load_run_config(None, ["model.family=llama", "data.seq_len=256"]), Topology(2, sequence=2))
    assert Topology.of({"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 1}, 4).data == 2


def test_the_chunked_loss_is_never_chosen_for_a_mixture_of_experts():
    from transformers import MixtralConfig, MixtralForCausalLM

    from bigtrain.models.hf_common import set_training_defaults
    from bigtrain.train.fast_path import chunked_unsupported
    from bigtrain.models import build
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
    set_training_defaults(config, "sdpa")
    module = MixtralForCausalLM(config)
    spec = build("llama", "tiny", vocab_size=64, seq_len=16)  # a causal-LM spec; the module decides
    assert "router" in chunked_unsupported(spec, module)


def test_an_export_by_tag_checks_the_digests(tmp_path):
    from bigtrain.checkpoint import store
    from bigtrain.checkpoint.state import CheckpointState, ModelBuild
    from bigtrain.export.locate import locate_checkpoint
    tag = tmp_path / "checkpoints" / "step_000002"
    tag.mkdir(parents=True)
    torch.save({"w": torch.arange(10_000.0)}, tag / "mp_rank_00_model_states.pt")
    torch.save({"rank": 0}, tag / "rng_rank0.pt")
    store.write_marker(tag, CheckpointState(step=2, world_size=1, model_build=ModelBuild("gpt2", "tiny", {})))
    assert locate_checkpoint(tmp_path, "2").tag == "step_000002"
    with (tag / "mp_rank_00_model_states.pt").open("r+b") as f:
        f.seek(2000)
        f.write(os.urandom(512))
    with pytest.raises(ValueError, match="mp_rank_00_model_states.pt changed since it was saved"):
        locate_checkpoint(tmp_path, "2")


def test_deepspeeds_old_bfloat16_name_is_bf16():
    from bigtrain.train.engine import float_dtype_of
    assert float_dtype_of({"bfloat16": {"enabled": True}}) == torch.bfloat16
    assert float_dtype_of({"bf16": {"enabled": False}}) == torch.float32


def test_a_tensor_group_larger_than_the_key_value_heads_is_said_on_the_console():
    """It trains correctly, but DeepSpeed only says so in the rank's log: the ranks past the key-value heads hold
    no attention shard of their own."""
    from bigtrain.models import build
    from bigtrain.parallel.split_rules import kv_heads_line
    from bigtrain.config.topology import Topology
    from messages import naming
    spec = build("llama", "custom", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=160,
                 vocab_size=256, seq_len=32)
    line = kv_heads_line(spec, Topology(4, tensor=4))
    assert naming(line, "parallel.tensor=4", "2 key-value heads", "correct"), line
    assert kv_heads_line(spec, Topology(2, tensor=2)) is None
