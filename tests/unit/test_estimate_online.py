"""`bigtrain estimate` for an objective that generates: a generation round's KV cache, the weights
gathered at ZeRO-3, the reference copy (beta > 0) and the reward model or teacher, each measured beside the estimate
on CPU. Each would catch: the KV term off by a layer, a factor of K+V or grouped-query attention's kv_heads, or
counting a micro-batch where a round answers the whole step; the gathered weights missing at ZeRO-3 or counted
with gathering off; a frozen model's bytes not its parameters'; a recommended command that training refuses."""
from __future__ import annotations

import shlex
from dataclasses import replace
from types import SimpleNamespace

import torch

from bigtrain.config.load import load_run_config
from bigtrain.estimate.live_bytes import LiveBytes
from bigtrain.estimate.memory_model import estimate, setup_from_run
from bigtrain.estimate.shape import frozen_params, shape_from_spec
from bigtrain.models import build

VOCAB, SEQ, COMPLETION, ROWS = 256, 40, 32, 8
PAD, EOS = 0, 1
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, name_or_path="test")
# 8 layers: transformers' DynamicCache grows by concatenation, holding one layer's key twice (1/16 of the cache)
MODEL = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=8, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=128)


def grpo_run(*sets: str):
    return load_run_config(None, ["model.family=llama", "model.size=tiny", "precision=fp32", f"data.seq_len={SEQ}",
                                  "objective.kind=grpo", "objective.rewards=[length]", "objective.num_generations=4",
                                  f"objective.max_completion_length={COMPLETION}", f"batch.micro_batch={ROWS // 2}",
                                  "batch.grad_accum=2", *sets])


def test_the_kv_cache_term_is_what_a_generation_round_holds():
    """LiveBytes around a real round (bigtrain.rollout.generate, the policy's own path) on a tiny grouped-query
    Llama: its peak is the estimate's KV term within 15% (the rest: the last layer's key held twice while it grows,
    one step's logits); the round answers micro_batch x grad_accum rows, not one micro-batch."""
    from bigtrain.rollout.generate import SampleRNG, Sampling, generate
    spec = build("llama", "tiny", **MODEL)
    setup = setup_from_run(grpo_run(*[f"model.overrides.{k}={v}" for k, v in MODEL.items() if k != "seq_len"]), 1, 1)
    assert setup.completion_tokens == COMPLETION and setup.micro_batch * setup.grad_accum == ROWS
    shape = shape_from_spec(spec, "fp32", tiled=False, chunked=False)
    assert shape.kv_per_token == 8 * 2 * 2 * 16  # layers x (K, V) x kv_heads x head_dim
    kv = estimate(shape, setup).kv_cache
    model = spec.build(seed=0).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (ROWS // 4, SEQ - COMPLETION), generator=generator)
    sampling = Sampling(max_new_tokens=COMPLETION, temperature=1.0, num_generations=4)
    with LiveBytes() as watch:
        rollout = generate(model, TOKENIZER, ids, torch.ones_like(ids), sampling, SampleRNG(0, 0, "cpu"))
    assert rollout.completion_ids.shape == (ROWS, COMPLETION)  # every row decoded to the end: the cache at its largest
    peak = watch.snapshot().peak
    assert kv == ROWS * SEQ * shape.kv_per_token * 4
    print(f"generation round: LiveBytes peak {peak} bytes, estimated KV cache {kv:.0f} ({peak / kv:.3f}x)")
    assert abs(peak - kv) <= 0.15 * kv, (peak, kv)


def test_gathered_weights_reference_and_reward_model_are_their_parameters(tmp_path):
    """At ZeRO-3 over 4 ranks: gathering on counts the whole policy (all but its persistent tensors) on the device,
    gathering off nothing, ZeRO-2 nothing; beta > 0 adds a reference copy partitioned like the policy; a reward
    model directory adds its own parameters' bytes, partitioned alike; each its own term."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(0)
    reward = LlamaForSequenceClassification(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=2, num_labels=1))
    reward.save_pretrained(tmp_path / "rm")
    reward_params = sum(p.numel() for p in reward.parameters())
    run = grpo_run("zero.stage=3", "zero.param_persistence_threshold=100", "objective.beta=0.04",
                   f"objective.reward_model={tmp_path / 'rm'}")
    spec = build("llama", "tiny", vocab_size=VOCAB, seq_len=SEQ)
    shape = shape_from_spec(spec, "fp32", tiled=False, chunked=False)
    setup = setup_from_run(run, 4, 4, frozen_params=frozen_params(run.objective, SEQ))
    held = estimate(shape, setup)
    persistent = shape.persistent_params(setup.param_persistence_threshold)
    assert setup.frozen_params == reward_params
    assert held.frozen == 4 * reward_params / 4
    assert held.reference == 4 * spec.num_params / 4 + 4 * persistent
    assert held.gathered == 4 * (spec.num_params - persistent) > 0
    assert held.device_peak >= held.params + held.reference + held.frozen + held.kv_cache + held.gathered
    assert estimate(shape, replace(setup, gather_for_generation=False)).gathered == 0
    assert estimate(shape, replace(setup, zero_stage=2)).gathered == 0
    plain = setup_from_run(grpo_run("zero.stage=3"), 4, 4)
    assert estimate(shape, plain).reference == 0 and estimate(shape, plain).frozen == 0


def test_the_recommended_command_is_one_training_takes(capsys):
    """The printed command carries the objective's settings (without objective.rewards an online run is refused)
    and names only flags and --set keys that exist; each objective term has its own line."""
    from bigtrain.cli import main
    from tests.unit.test_docs import Command, parsers, problems
    code = main(["estimate", "--model", "llama", "--size", "tiny", "--num-gpus", "2", "--gpu-mem", "8GiB",
                 "--micro-batch", "8", "--seq-len", "256", "--set", "objective.kind=grpo", "--set",
                 "objective.beta=0.04", "--set", "objective.max_completion_length=128", "--set",
                 "objective.rewards=[accuracy,length]"])
    out = capsys.readouterr().out
    assert code == 0
    for term in ("reference copy", "frozen models", "KV cache of a generation round", "weights gathered"):
        assert term in out
    line = next(line for line in out.splitlines() if line.strip().startswith("bigtrain train"))
    tokens = shlex.split(line)[1:]
    assert "objective.rewards=[accuracy,length]" in tokens and "objective.beta=0.04" in tokens
    verbs, run_parser = parsers()
    assert problems(Command("estimate", "verb", tokens), verbs, run_parser) == []
    sets = [tokens[i + 1] for i, t in enumerate(tokens) if t == "--set"]
    run = load_run_config(None, ["model.family=llama", "model.size=tiny", *sets])
    assert run.objective.kind == "grpo" and run.objective.settings.rewards == ["accuracy", "length"]
    assert run.objective.settings.max_completion_length == 128 and run.objective.declared.references


def test_a_batch_training_refuses_is_one_line(capsys):
    """micro_batch x grad_accum must hold whole groups (8 completions a prompt): one line, as training says; with
    the accumulation given, the round (and its KV cache) answers both, and the command keeps it."""
    from bigtrain.cli import main
    args = ["estimate", "--model", "llama", "--size", "tiny", "--seq-len", "256", "--micro-batch", "2", "--set",
            "objective.max_completion_length=128", "--set", "objective.kind=grpo", "--set",
            "objective.rewards=[length]"]
    assert main([*args, "--set", "batch.grad_accum=4"]) == 0
    out = capsys.readouterr().out
    assert "KV cache of a generation round (8 rows" in out and "--set batch.grad_accum=4" in out
    code = main(["estimate", "--model", "llama", "--size", "tiny", "--seq-len", "256", "--set",
                 "objective.max_completion_length=128", "--set",
                 "objective.kind=grpo", "--set", "objective.rewards=[length]"])
    err = capsys.readouterr().err
    assert code != 0 and "not a multiple of 8" in err and "Traceback" not in err


def test_the_launchers_check_resolves_gathering_by_the_devices_memory():
    """objective.ds3_gather_for_generation=auto as a run resolves it: the whole weights gathered where they take at
    most half of a device, left partitioned where they do not; false never gathers."""
    from bigtrain.estimate.of_run import estimate_run
    run = grpo_run("zero.stage=3", "zero.param_persistence_threshold=100")
    weights = 4 * estimate_run(run, 2, 2)[1].num_params  # the model the run builds (its own vocabulary)
    assert estimate_run(run, 2, 2, gpu_mem=2 * weights + 8)[0].gathered > 0
    assert estimate_run(run, 2, 2, gpu_mem=2 * weights - 8)[0].gathered == 0
    off = grpo_run("zero.stage=3", "zero.param_persistence_threshold=100", "objective.ds3_gather_for_generation=false")
    assert estimate_run(off, 2, 2, gpu_mem=10**12)[0].gathered == 0
