"""The memory model under tensor and sequence parallelism, and `bigtrain estimate` recommending sequence
parallelism when activations, not states, are what does not fit."""
from __future__ import annotations

import pytest

from bigtrain.estimate.memory_model import ModelShape, Setup, estimate

SHAPE = ModelShape(family="gpt2", num_params=10**9, n_layer=24, hidden=2048, heads=16, seq_len=8192, vocab=50304,
                   profile="gpt2-sdpa")


def test_tensor_parallel_divides_states_and_part_of_the_activations():
    one = estimate(SHAPE, Setup(world_size=8, zero_stage=1, precision="bf16"))
    tp2 = estimate(SHAPE, Setup(world_size=8, zero_stage=1, precision="bf16", tensor=2))
    assert tp2.params == pytest.approx(one.params / 2) and tp2.grads == pytest.approx(one.grads / 2)
    assert tp2.optimizer == pytest.approx(one.optimizer)  # psi/2 over 4 data-parallel ranks = psi over 8
    blocks = lambda e: e.activations  # noqa: E731
    assert blocks(one) * (10 + 12) / 34 < blocks(tp2) < blocks(one)  # 10sbh whole, 24sbh split
    assert tp2.setup.label == "zero1+tp2"


def test_tensor_parallel_keeps_the_embeddings_and_norms_whole():
    """What AutoTP leaves unsplit (measured against real TP2 ranks: tests/dist/test_parallel_modes.py) is counted
    on every rank: a Llama shape's embedding and norms, not its linear layers or its head."""
    from bigtrain.estimate.shape import shape_from_spec
    from bigtrain.models import build
    shape = shape_from_spec(build("llama", "tiny", vocab_size=512, seq_len=64))
    cfg = build("llama", "tiny", vocab_size=512, seq_len=64).config
    assert shape.tensor_whole_params == cfg.vocab_size * cfg.hidden_size + (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size
    one = estimate(shape, Setup(world_size=2, zero_stage=1, precision="fp32"))
    tp2 = estimate(shape, Setup(world_size=2, zero_stage=1, precision="fp32", tensor=2))
    whole = 4 * shape.tensor_whole_params
    assert tp2.params == pytest.approx((one.params - whole) / 2 + whole)


def test_sequence_parallel_divides_every_activation_and_keeps_zero_over_all_ranks():
    one = estimate(SHAPE, Setup(world_size=8, zero_stage=3, precision="bf16"))
    sp4 = estimate(SHAPE, Setup(world_size=8, zero_stage=3, precision="bf16", sequence=4))
    assert sp4.activations == pytest.approx(one.activations / 4)
    assert sp4.model_states == pytest.approx(one.model_states)  # ZeRO still partitions over data x sequence


@pytest.mark.parametrize("args, named", [
    (["--model", "llama", "--size", "tiny", "--tensor", "2", "--sequence", "4"],
     "parallel.tensor=2 x parallel.sequence=4: the model's 4 attention heads"),
    (["--model", "gpt2", "--size", "small", "--tensor", "2"], "does not support tensor"),
    (["--model", "gpt2", "--size", "small", "--sequence", "2"], "does not support sequence"),
    (["--model", "llama", "--size", "1b", "--sequence", "2", "--seq-len", "1023"], "not divisible by parallel.sequence")])
def test_estimate_refuses_the_splits_training_refuses(args, named, capsys):
    """With train's own line: no estimate recommends a setup `bigtrain train` would refuse."""
    from bigtrain.cli import main
    code = main(["estimate", *args, "--num-gpus", "8"])
    out, err = capsys.readouterr()
    assert code == 2 and named in err and "recommended" not in out, err


def test_a_world_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="not divisible by parallel.tensor=4"):
        Setup(world_size=6, tensor=4)


def test_estimate_recommends_sequence_parallelism_when_activations_do_not_fit(capsys):
    from bigtrain.cli import main
    long = ["estimate", "--model", "llama", "--size", "1b", "--seq-len", "131072", "--gpu-mem", "5"]
    assert main(long) == 1
    err = capsys.readouterr().err
    assert "activations, not model states" in err and "--set parallel.sequence=2" in err
    assert main([*long, "--sequence", "2"]) == 0
    out = capsys.readouterr().out
    assert "parallel.sequence=2" in out and "+sp2" in out
