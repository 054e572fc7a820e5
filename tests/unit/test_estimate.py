"""The memory estimator: formulas against hand-computed numbers, activation profiles against the
tensors our models really save, and the CLI (per-rank bytes measured under ZeRO 0-3 on 2 ranks:
tests/dist/test_estimate_measured.py)."""
from __future__ import annotations

import pytest
import torch

from bigtrain.estimate.activations import transformer_activations
from bigtrain.estimate.memory_model import ModelShape, Setup, estimate, model_state_terms, parse_memory, setup_from_run
from bigtrain.estimate.recommend import all_setups, fits, recommend, speed_rank
from bigtrain.estimate.counting import measure_activations
from bigtrain.estimate.shape import shape_from_spec
from bigtrain.models import build
from messages import naming

PSI, N = 1e9, 64


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("24G", 24 * 2**30), ("1.5TB", 1.5e12), ("512MiB", 512 * 2**20),
    ("16 gb", 16 * 10**9), ("1024", 1024), (2048, 2048)])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["80 gigs", "", "GB", "-5GB", "0GB", "8.0.0GB"])
def test_parse_memory_rejects_nonsense(text):
    with pytest.raises(ValueError, match=r"--gpu-mem .*(80GB|positive)"):
        parse_memory(text, "--gpu-mem")


@pytest.mark.parametrize("precision, stage, expected", [
    # ZeRO paper, mixed-precision Adam (P=2, K=12), psi=1e9, N=64
    ("bf16", 0, 16e9), ("bf16", 1, 4e9 + 12e9 / 64), ("bf16", 2, 2e9 + 14e9 / 64), ("bf16", 3, 16e9 / 64),
    # fp32 as DeepSpeed lays it out: no master copy at stage 0 (4+4+8), one fp32 partition from stage 1 on
    ("fp32", 0, 16e9), ("fp32", 1, 8e9 + 12e9 / 64), ("fp32", 2, 4e9 + 16e9 / 64), ("fp32", 3, 20e9 / 64)])
def test_model_states_follow_zero_paper(precision, stage, expected):
    terms = model_state_terms(PSI, Setup(world_size=N, zero_stage=stage, precision=precision))
    assert terms["params"] + terms["grads"] + terms["optimizer"] == pytest.approx(expected)
    assert terms["host"] == terms["nvme"] == 0


def test_offload_moves_states_to_host_or_nvme():
    s2 = model_state_terms(PSI, Setup(world_size=N, zero_stage=2, offload_optimizer="cpu"))
    assert (s2["params"], s2["grads"], s2["optimizer"]) == (2e9, 0, 0)
    assert s2["host"] == pytest.approx(18e9 / 64)  # master 4 + moments 8 + fp32 grads 4 + 16-bit params 2
    s3 = model_state_terms(PSI, Setup(world_size=N, zero_stage=3, offload_optimizer="cpu"))
    assert s3["params"] == pytest.approx(2e9 / 64) and s3["host"] == pytest.approx(16e9 / 64)
    inf = model_state_terms(PSI, Setup(world_size=N, zero_stage=3, offload_optimizer="nvme", offload_param="nvme"),
                            persistent=1e6)
    assert inf["params"] == 2e6 and inf["host"] == 0 and inf["nvme"] == pytest.approx(18e9 / 64)


def test_zero2_matches_deepspeeds_own_estimator():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    _, gpu = estimate_zero2_model_states_mem_needs(int(PSI), num_gpus_per_node=8, num_nodes=8, cpu_offload=False)
    shape = ModelShape("toy", int(PSI), n_layer=1, hidden=8, heads=1, seq_len=1)
    est = estimate(shape, Setup(world_size=N, zero_stage=2))
    assert est.model_states + est.step_transient == pytest.approx(gpu, rel=1e-6)  # 2 + 18/N (fp32 grads at step)


def test_setup_rejects_impossible_combinations():
    with pytest.raises(ValueError, match=r"offload.param=cpu needs stage 3 \(got stage 2\)"):
        Setup(world_size=8, zero_stage=2, offload_param="cpu")
    with pytest.raises(ValueError, match=r"offload.optimizer=cpu needs stage 1-3 \(got stage 0\)"):
        Setup(world_size=8, zero_stage=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match="precision 'fp8'"):
        Setup(world_size=8, precision="fp8")


def test_korthikanti_activations_gpt3():
    """Korthikanti et al. 2022, 16-bit with dropout: 34sbh + 5as^2b per layer; checkpointing keeps 2sbh per layer."""
    shape = ModelShape("gpt", 175_000_000_000, n_layer=96, hidden=12288, heads=96, seq_len=2048, profile="korthikanti",
                       dropout=0.1)
    count = transformer_activations(shape, bytes_per_value=2)
    assert count.largest_block == 2_868_903_936
    assert count.blocks == 96 * 2_868_903_936
    assert count.block_inputs == 4_831_838_208
    flash = transformer_activations(ModelShape(**{**shape.__dict__, "profile": "korthikanti-flash"}), 2)
    assert flash.largest_block == 34 * 2048 * 12288


@pytest.mark.parametrize("family, overrides", [
    ("gpt2", {"attn_implementation": "sdpa"}), ("gpt2", {"attn_implementation": "eager"}), ("encoder", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_profiles_match_saved_tensors(family, overrides, dtype):
    """The formula against the bytes our real models save for backward (counted on CPU)."""
    spec = build(family, "custom", n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=1000, **overrides)
    shape = shape_from_spec(spec)
    e = 4 if dtype == torch.float32 else 2
    formula = transformer_activations(shape, e)
    measured = measure_activations(spec, dtype, device="cpu")
    assert formula.outside + formula.blocks == pytest.approx(measured.outside + measured.blocks, rel=0.10)
    assert formula.largest_block == pytest.approx(measured.largest_block, rel=0.10)
    assert formula.block_inputs == measured.block_inputs == 2 * 128 * 128 * e


def test_resnet_activations_on_meta_equal_cpu():
    spec = build("resnet", "tiny")
    meta = measure_activations(spec, torch.float32)
    cpu = measure_activations(spec, torch.float32, device="cpu")
    assert meta.blocks == pytest.approx(cpu.blocks, rel=0.01) and meta.blocks > 0
    assert meta.outside == pytest.approx(cpu.outside, rel=0.01)
    est = estimate(shape_from_spec(spec, "fp32"), Setup(world_size=1, precision="fp32", micro_batch=8))
    assert est.activations == pytest.approx(8 * (meta.outside + meta.blocks), rel=1e-9)


def test_a_decoders_sdpa_activations_on_meta_are_what_the_fused_kernel_saves():
    """On the meta device sdpa would run its math kernel and save [s, s] probabilities (4.7x the real count at
    2048 tokens); the estimate counts what the fused kernel training runs saves, here CPU's flash attention."""
    spec = build("llama", "custom", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=160,
                 vocab_size=256, seq_len=1024, n_positions=1024)
    meta = measure_activations(spec, torch.float32)
    cpu = measure_activations(spec, torch.float32, device="cpu")
    assert meta.outside + meta.blocks == pytest.approx(cpu.outside + cpu.blocks, rel=0.05)
    assert meta.blocks < 2 * 1024 * 1024 * 4 * 4  # not one layer's fp32 [heads, s, s] probabilities


def test_recommendation_is_the_fastest_setup_that_fits():
    shape = shape_from_spec(build("gpt2", "xl"))
    rows = [estimate(shape, s) for s in all_setups(Setup(world_size=16, gpus_per_node=8, micro_batch=4))]
    assert len(rows) == 20 and len({r.setup.label for r in rows}) == 20
    for gpu_mem in (80e9, 24e9, 12e9):
        best = recommend(rows, gpu_mem)
        assert best is not None and fits(best, gpu_mem)
        faster = [r for r in rows if speed_rank(r.setup) < speed_rank(best.setup)]
        assert not any(fits(r, gpu_mem) for r in faster)
    assert recommend(rows, 1e9) is None


def test_setup_from_run_config():
    from bigtrain.config.run_config import ActivationCheckpointConfig, BatchConfig, OffloadConfig, RunConfig, ZeroConfig
    run = RunConfig(batch=BatchConfig(global_batch=64, micro_batch=2), zero=ZeroConfig(stage=3),
                    offload=OffloadConfig(optimizer="cpu"), activation_checkpointing=ActivationCheckpointConfig(True))
    s = setup_from_run(run, world_size=16, gpus_per_node=8)
    assert (s.zero_stage, s.offload_optimizer, s.checkpointing, s.micro_batch, s.grad_accum) == (3, "cpu", True, 2, 2)
    assert s.precision == "bf16"  # `auto` is bf16 on the accelerators the estimate is for


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """`bigtrain estimate ARGS` as bigtrain.cli runs a verb: a ValueError is one line on stderr and exit 2."""
    import argparse
    import sys

    from bigtrain.estimate.arguments import add_estimate_parser
    parser = argparse.ArgumentParser(prog="bigtrain")
    add_estimate_parser(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["estimate", *args])
    try:
        code = parsed.func(parsed)
    except ValueError as err:
        print(f"bigtrain estimate: {err}", file=sys.stderr)
        code = 2
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_gpt2_xl_on_16_gpus(capsys):
    code, out, _ = run_cli(["--model", "gpt2", "--size", "xl", "--num-gpus", "8", "--num-nodes", "2",
                            "--gpu-mem", "80GB", "--micro-batch", "4"], capsys)
    assert code == 0
    assert naming(out, "gpt2 xl", "1,557.6M parameters", "16 ranks", "8 per node", "2 nodes", "bf16", "micro-batch 4",
                  "seq 1024"), out
    rows = [line for line in out.splitlines() if line.startswith("zero")]
    assert len(rows) == 20
    zero0 = rows[0].split()
    assert zero0[0] == "zero0"
    assert float(zero0[1]) == pytest.approx(2 * build("gpt2", "xl").num_params / 2**30, abs=0.05)  # bf16 params
    assert "recommended: zero0 (" in out and "--set zero.stage=0" in out
    code, out, _ = run_cli(["--model", "gpt2", "--size", "xl", "--num-gpus", "8", "--num-nodes", "2",
                            "--gpu-mem", "16GB", "--micro-batch", "4"], capsys)
    best = out.split("recommended: ")[1].split()[0]
    assert code == 0 and best != "zero0"
    assert next(r for r in out.splitlines() if r.split()[:1] == [best]).endswith("yes")


def test_cli_errors_are_one_line(capsys):
    code, _, err = run_cli(["--model", "gpt2", "--size", "xl", "--gpu-mem", "lots"], capsys)
    assert code == 2 and "--gpu-mem 'lots' is not a memory size" in err
    code, _, err = run_cli(["--model", "resnet", "--size", "50", "--seq-len", "128"], capsys)
    assert code == 2 and "--seq-len applies to token models" in err
    code, _, err = run_cli(["--model", "gpt2", "--size", "tiny", "--gpu-mem", "10MB"], capsys)
    assert code == 1 and "nothing fits" in err


def test_estimate_takes_the_run_configs_grammar(tmp_path, capsys):
    """One grammar for every verb: --config and --set section.field=VALUE, as `bigtrain train` takes them; the
    estimate's flags are shorthands for the same fields, so either spelling gives the same table."""
    flags = ["--model", "gpt2", "--size", "small", "--seq-len", "512", "--micro-batch", "2", "--gpu-mem", "24"]
    code, by_flags, _ = run_cli(flags, capsys)
    sets = ["--set", "model.family=gpt2", "--set", "model.size=small", "--set", "data.seq_len=512",
            "--set", "batch.micro_batch=2", "--gpu-mem", "24"]
    assert code == 0 and run_cli(sets, capsys)[:2] == (0, by_flags)
    config = tmp_path / "run.yaml"
    config.write_text("model: {family: gpt2, size: small}\ndata: {seq_len: 512}\nbatch: {micro_batch: 2}\n"
                      "zero: {stage: 3}\n")
    code, by_config, err = run_cli(["--config", str(config), "--gpu-mem", "24"], capsys)
    assert (code, by_config) == (0, by_flags)
    assert "not read by the estimate, which tabulates every setup: zero.stage" in err  # said, never silently dropped
    code, out, _ = run_cli([*flags, "--set", "model.overrides.n_layer=4"], capsys)
    assert code == 0 and "--set model.overrides.n_layer=4" in out and out.split("M parameters")[0] != \
        by_flags.split("M parameters")[0]


def test_the_old_model_override_spelling_is_one_line_giving_the_new_one(capsys):
    code, out, err = run_cli(["--model", "gpt2", "--size", "small", "--set", "n_layer=24"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--set model.overrides.n_layer=VALUE" in err
    from bigtrain.cli import main
    assert main(["models", "gpt2", "--set", "seq_len=128"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--set model.overrides.seq_len=128" in err
    assert main(["models", "gpt2", "--set", "model.overrides.seq_len=128"]) == 0
    assert "gpt2     small" in capsys.readouterr().out


def test_a_training_commands_model_flags_estimate_a_pretrained_directory(tmp_path, capsys):
    """`--model hf --set model.pretrained=DIR`, copied from a training command, needs no --size."""
    from transformers import LlamaConfig
    LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=128, vocab_size=512, max_position_embeddings=128).save_pretrained(tmp_path / "m")
    code, out, err = run_cli(["--model", "hf", "--set", f"model.pretrained={tmp_path / 'm'}", "--gpu-mem", "8",
                              "--num-gpus", "8"], capsys)
    assert code == 0 and out.startswith("hf custom: "), err
    assert f"--set model.pretrained={tmp_path / 'm'}" in out
    code, _, err = run_cli(["--size", "small"], capsys)
    assert code == 2 and "--model is missing" in err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_keeps_what_the_estimate_counts(dtype):
    """What the chunked loss saves for backward, counted from its saved tensors on CPU, against the formula: the
    gradient of the head's input per token, and the head weight's fp32 gradient once per micro-batch; none of the
    plain loss's fp32 logits per token."""
    from bigtrain.estimate.activations import chunked_loss_bytes
    from bigtrain.models.chunked_loss import causal_lm_chunked_loss, default_chunk_rows
    rows, seq, h, vocab = 3, 64, 32, 1000
    e = 4 if dtype == torch.float32 else 2
    hidden = torch.randn(rows, seq, h, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=dtype, requires_grad=True)
    inputs = {hidden.untyped_storage()._cdata, weight.untyped_storage()._cdata}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        causal_lm_chunked_loss(hidden, weight, torch.randint(0, vocab, (rows, seq)))
    kept = sum(n for key, n in saved.items() if key not in inputs)
    shape = ModelShape("gpt", 0, n_layer=1, hidden=h, heads=1, seq_len=seq, vocab=vocab)
    plain, chunked = transformer_activations(shape, e), transformer_activations(shape, e, chunked_loss=True)
    per_token = (chunked.outside - (plain.outside - seq * vocab * 4)) / seq  # what chunking puts in the logits' place
    chunk = min(default_chunk_rows(vocab), rows * seq)
    once = chunked_loss_bytes(shape, e, rows * seq) - chunk * vocab * (4 + (e if e < 4 else 0))
    print(f"chunked loss, {dtype}: saved {kept} B, formula {rows * seq * per_token + once:.0f} B")
    assert kept == rows * seq * per_token + once == rows * seq * h * e + 4 * vocab * h
    assert chunked.transient == 0 and plain.transient == seq * vocab * 8


def test_the_estimate_resolves_the_loss_as_training_does():
    """train.loss_impl=auto is the chunked loss on a GPU for a plain causal LM (fewer activation bytes), the plain
    one with explicit plain, an objective that refuses it or tensor parallelism, and on a CPU: training's own rules
    (`fast_path.resolve_loss_impl`), asked of the meta-device module the estimate counts."""
    from bigtrain.estimate.shape import meta_module
    from bigtrain.train.fast_path import resolve_loss_impl
    spec = build("gpt2", "small")
    meta = meta_module(spec)

    def chunked(setting, device="cuda", tensor=1, allowed=True):
        return resolve_loss_impl(setting, device, spec, meta, tensor, allowed) == "chunked"
    assert chunked("auto") and chunked("chunked", device="cpu")
    assert not chunked("plain") and not chunked("auto", device="cpu")
    assert not chunked("auto", allowed=False) and not chunked("auto", tensor=2)
    shape = shape_from_spec(spec, "bf16")
    plain = estimate(shape, Setup(world_size=1, micro_batch=8))
    chunked = estimate(shape, Setup(world_size=1, micro_batch=8, chunked_loss=True))
    logits = 8 * shape.seq_len * shape.vocab * 12  # fp32 log-probabilities kept, and two fp32 gradients at backward
    assert plain.activations - chunked.activations > 0.5 * logits


def test_the_estimate_meets_the_gpu_measurements_of_both_losses():
    """docs/benchmarks_gpu.json's H200 pair (GPT-2 small, padded vocabulary, bf16, 16 x 1024 tokens, ZeRO-1):
    DeepSpeed's loop with the plain loss and bigtrain's defaults with the chunked one; the estimate is within 2% under
    and 5% over each measured peak."""
    import json
    from pathlib import Path
    runs = json.loads((Path(__file__).parents[2] / "docs" / "benchmarks_gpu.json").read_text())["results"]
    peak = {r["runner"]: max(r["peak_rss_per_rank"]) for r in runs if r["case"].startswith("gpt2-small z1")}
    shape = shape_from_spec(build("gpt2", "small", vocab_size=50304), "bf16")
    for runner, chunked in (("deepspeed", False), ("bigtrain", True)):
        estimated = estimate(shape, Setup(world_size=1, zero_stage=1, micro_batch=16, chunked_loss=chunked))
        print(f"{runner}: measured {peak[runner] / 1e9:.2f} GB, estimated {estimated.device_peak / 1e9:.2f} GB")
        assert peak[runner] * 0.98 <= estimated.device_peak <= peak[runner] * 1.05


def test_the_launchers_memory_check_counts_a_pair_objective_as_training_runs_it():
    """setup_from_run (bigtrain train's preflight) doubles a preference sample's rows and holds the frozen copy that
    training resolves objective.reference to; with LoRA the adapters-off reference holds none."""
    from bigtrain.config.load import load_run_config
    dpo = setup_from_run(load_run_config(None, ["objective.kind=dpo"]), 1, 1)
    assert dpo.rows_per_sample == 2 and dpo.reference == "copy"
    lora = setup_from_run(load_run_config(None, ["objective.kind=dpo", "lora.r=8", "model.family=llama"]), 1, 1)
    assert lora.rows_per_sample == 2 and lora.reference == "adapters_off"
    plain = setup_from_run(load_run_config(None, []), 1, 1)
    assert plain.rows_per_sample == 1 and plain.reference == "none"


def test_without_the_machine_the_first_line_says_what_it_assumed_and_a_fine_tune_keeps_its_defaults(capsys, tmp_path):
    """No --num-gpus / --gpu-mem: the first line says the 8 x 80 GiB node it assumed (this machine is not read); the
    command it recommends for a pretrained model, loaded as `bigtrain train` loads it, fine-tunes at the objective's
    fine-tuning defaults, as the line under it says."""
    import shlex

    import rl_task
    from bigtrain.config.flags import build_run_parser, run_config_from_args
    from bigtrain.metrics.logs import route_library_logs
    route_library_logs()  # as `bigtrain` routes DeepSpeed's own lines: off stdout, which the estimate speaks on
    rl_task.make_model(0, tmp_path / "tiny")
    code, out, _ = run_cli(["--model", "hf", "--pretrained", str(tmp_path / "tiny")], capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("assumed: 8 GPUs per node, 80 GiB each (--num-gpus and --gpu-mem not "
                                             "given; "), lines[0]
    assert lines[0].endswith("give --num-gpus N and --gpu-mem SIZE for yours") and "8 ranks" in lines[1]
    command = next(i for i, line in enumerate(lines) if line.startswith("  bigtrain train "))
    run = run_config_from_args(build_run_parser().parse_args(shlex.split(lines[command])[2:]))
    from bigtrain.config.defaults import choose
    tuning = choose(str(tmp_path / "tiny"), "lm", lora=False)
    assert (run.optimizer.lr, run.optimizer.weight_decay, run.optimizer.betas, run.schedule.warmup_steps) == (
        tuning.lr, tuning.weight_decay, tuning.betas, tuning.warmup_steps) and tuning.betas == (0.9, 0.999)
    assert lines[command + 1].startswith("  which trains with adamw: lr 2e-05, weight decay 0, betas (0.9, 0.999), ")
    assert "(the fine-tuning defaults of objective.kind=lm from a pretrained model;" in lines[command + 1]
    code, out, _ = run_cli(["--model", "hf", "--pretrained", str(tmp_path / "tiny"), "--num-gpus", "2",
                            "--gpu-mem", "24GB"], capsys)
    assert code == 0 and "assumed" not in out and "2 ranks" in out.splitlines()[0]
