"""LoRA through peft on real ranks: adapters on a frozen base at ZeRO 0-3 and with offload give the losses
of LoRA on one process; only the adapters have optimizer states; the base weights come out of training unchanged;
a stop and resume continues the uninterrupted curve; the merged export and the adapter export give the trained
model's logits.

Two launches share the work: 2 ranks (micro 4 x dp 2) for ZeRO 0-3, ZeRO-3 with CPU offload, activation
checkpointing, sequence parallelism, GPT-2, chats, the stop and its resume, and a full fine-tune for the model-state
bytes; then one process for the references (a Llama and a GPT-2 directory made here, fine-tuned with lora.r=8 at
global batch 8: micro 4 x accumulation 2, and the Llama with a chat template on packed chats) and the stopped run's
resume on another world size (a universal checkpoint). A large learning rate moves the adapters far from their
start in 4 steps, so an export that dropped or mis-merged them could not pass.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from launch import launch_jobs, summary
from local_lora import base_weights, make_base_dirs, make_chat_base
from messages import naming

RTOL = 1e-5
STEPS = 4
R = 8
COMMON = ["--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--steps", str(STEPS), "--set", "train.eval_interval=0", "--set", "batch.micro_batch=4",
          "--set", "batch.global_batch=8", "--set", "data.seq_len=32", "--set", "optimizer.lr=1e-2",
          "--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=1"]
LORA = ["--set", f"lora.r={R}", "--set", "lora.alpha=16"]
# Packed chats, the loss on the answers: a micro-batch's loss is the mean over its answer tokens, so one sequence per
# micro-batch keeps one process's accumulation and two ranks' batches weighing the sequences alike.
CHAT = ["--set", "data.packing=true", "--set", "batch.micro_batch=1"]
TWO_RANK = {  # name -> (base, extra flags); every one compared with its base's one-process reference
    "z0": ("llama", ["--set", "zero.stage=0"]),
    "z1": ("llama", ["--set", "zero.stage=1"]),
    "z2": ("llama", ["--set", "zero.stage=2"]),
    "z3": ("llama", ["--set", "zero.stage=3"]),
    "z3_offload": ("llama", ["--set", "zero.stage=3", "--set", "offload.optimizer=cpu", "--set", "offload.param=cpu"]),
    "z3_ckpt": ("llama", ["--set", "zero.stage=3", "--set", "activation_checkpointing.enabled=true"]),
    "z3_sp2": ("llama", ["--set", "zero.stage=3", "--set", "parallel.sequence=2"]),
    "gpt2_z3": ("gpt2", ["--set", "zero.stage=3"]),
    "chat_z3": ("chat", ["--set", "zero.stage=3", *CHAT]),
}


def base_args(dirs: dict[str, Path], base: str) -> list[str]:
    """`--model llama` for the Llama directory, `--model hf` (any causal-LM directory) for GPT-2 and the Llama with
    a chat template, which trains on a chat jsonl."""
    if base == "chat":
        return ["--model", "hf", "--set", f"model.pretrained={dirs['chat_llama']}", "--data", str(dirs["chats"]),
                *COMMON]
    family = "llama" if base == "llama" else "hf"
    return ["--model", family, "--set", f"model.pretrained={dirs[base]}", "--data", str(dirs["corpus"]), *COMMON]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    dirs = {**make_base_dirs(root / "bases"), **make_chat_base(root / "bases")}
    (root / "dirs.json").write_text(json.dumps({k: str(v) for k, v in dirs.items()}))

    def job(name: str, base: str, *extra: str, **more: object) -> dict:
        return {"name": name, "args": [*base_args(dirs, base), *extra], **more}

    two = [job(name, base, *LORA, *extra) for name, (base, extra) in TWO_RANK.items()]
    two += [job("stop", "llama", *LORA, "--set", "zero.stage=3", "--stop-after", "2"),
            job("resumed", "llama", *LORA, "--set", "zero.stage=3", "--resume", copy_from="stop"),
            job("full_z3", "llama", "--set", "zero.stage=3"),
            job("other_lora", "llama", "--set", "lora.r=4", "--set", "zero.stage=3", "--resume", copy_from="stop",
                expect_error=True)]
    launch_jobs(root, two, num_ranks=2, name="two")
    launch_jobs(root, [job("ref_llama", "llama", *LORA), job("ref_gpt2", "gpt2", *LORA),
                       job("ref_chat", "chat", *LORA, *CHAT),
                       job("resumed_on_one", "llama", *LORA, "--set", "zero.stage=3", "--resume", copy_from="stop")],
                num_ranks=1, name="one")
    return root


def dirs_of(runs: Path) -> dict[str, Path]:
    return {k: Path(v) for k, v in json.loads((runs / "dirs.json").read_text()).items()}


def worst(reference: list[float], losses: list[float]) -> float:
    assert len(losses) == len(reference) == STEPS
    return max(abs(a - b) / abs(a) for a, b in zip(reference, losses))


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_lora_on_two_ranks_trains_like_one_process(runs, name):
    base = TWO_RANK[name][0]
    ran, ref = summary(runs / name), summary(runs / f"ref_{base}")
    margin = worst(ref["losses"], ran["losses"])
    print(f"{name} vs ref_{base}: worst relative loss difference {margin:.2e}")
    assert margin <= RTOL, (ref["losses"], ran["losses"])
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # the adapters learned something
    assert ran["run_config"]["lora"]["r"] == R and ran["ds_config"]["train_batch_size"] == 8


@pytest.mark.parametrize("name, rel", [("resumed", 0), ("resumed_on_one", 1e-6)])
def test_a_stopped_lora_run_resumes_on_the_uninterrupted_curve(runs, name, rel):
    """On its 2 ranks exactly; on one process through DeepSpeed's universal checkpoint (another reduction order)."""
    resumed, whole = summary(runs / name)["losses"], summary(runs / "z3")["losses"]
    print(f"{name} vs uninterrupted: {max(abs(a - b) / a for a, b in zip(resumed, whole)):.2e}")
    assert len(resumed) == STEPS and resumed == pytest.approx(whole, rel=rel, abs=0)


def test_a_resume_with_other_lora_settings_is_one_line(runs):
    error = (runs / "other_lora" / "error.txt").read_text()
    assert "\n" not in error and "lora.r=8" in error and "lora.r=4" in error and "--resume" in error


def test_only_the_adapters_have_optimizer_states(runs):
    """DeepSpeed's optimizer files hold the fp32 masters and Adam's two moments of each rank's partition: summed
    over the ranks, exactly the adapters' parameters (no base weight is in the optimizer)."""
    from bigtrain.checkpoint.safe_load import load_torch_file
    from bigtrain.export.weights import consolidate
    from bigtrain.models import build
    adapters = sum(t.numel() for n, t in _consolidated(runs / "z3", consolidate, build).items() if ".lora_" in n)
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 160), (64, 160), (160, 64)]  # q k v o gate up down
    assert adapters == 2 * R * sum(i + o for i, o in shapes)  # 2 layers; A is r x in, B is out x r
    for name, files in (("z3", "zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                        ("z1", "*zero_pp_rank_*_mp_rank_00_optim_states.pt")):
        masters = moments = 0
        for path in sorted((runs / name / "checkpoints" / "step_000004").glob(files)):
            state = load_torch_file(path, map_location="cpu")["optimizer_state_dict"]
            flat = state.get("fp32_flat_groups") or state.get("single_partition_of_fp32_groups")
            masters += sum(t.numel() for t in flat)
            inner = state.get("optimizer_state_dict") or state.get("base_optimizer_state")
            inner = inner["state"] if isinstance(inner, dict) and "state" in inner else inner
            states = inner.values() if isinstance(inner, dict) else inner
            moments += sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in states)
        print(f"{name}: {masters} fp32 master and {moments} Adam moment elements over 2 ranks for {adapters} adapter "
              "parameters")
        assert masters == adapters and moments == 2 * adapters, name


def test_the_base_weights_are_unchanged_by_training(runs):
    from bigtrain.export.weights import consolidate
    from bigtrain.models import build
    base = base_weights(dirs_of(runs)["llama"])
    for name in ("z3", "z1", "z3_offload"):
        trained = _consolidated(runs / name, consolidate, build)
        frozen = {n.replace(".base_layer.", "."): t for n, t in trained.items() if ".lora_" not in n}
        assert set(frozen) == set(base), set(frozen) ^ set(base)
        changed = [n for n, t in frozen.items() if not torch.equal(t.float(), base[n].float())]
        assert not changed, f"{name}: base weights changed: {changed[:4]}"
        lora_b = [t for n, t in trained.items() if ".lora_B." in n]
        assert min(float(t.detach().abs().max()) for t in lora_b) > 1e-3  # every adapter moved (they start at B = 0)


def test_full_fine_tuning_holds_more_model_state_than_lora(runs):
    full, lora = (max(summary(runs / n)["model_state_bytes_per_rank"]) for n in ("full_z3", "z3"))
    print(f"model states per rank, ZeRO-3 on 2 ranks: full {full} B, LoRA r={R} {lora} B")
    assert lora < 0.7 * full


@pytest.mark.parametrize("name, base", [("z3", "llama"), ("z1", "llama"), ("gpt2_z3", "gpt2")])
def test_the_merged_and_the_adapter_exports_give_the_trained_models_logits(runs, tmp_path, name, base):
    """Each export verifies itself against the base + adapters rebuilt from the checkpoint; here, independently, the
    merged directory through transformers and the adapter directory through peft on the user's base directory give
    the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    diffs = {}
    for kind, extra in (("merged", []), ("adapter", ["--adapter"])):
        out = _export(runs / name, tmp_path / kind, *extra)[1]
        diffs[kind] = float(re.search(r"largest logit difference on a fixed batch (\S+)", out).group(1))
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dirs_of(runs)[base]),
                                        tmp_path / "adapter").eval()
    plain = AutoModelForCausalLM.from_pretrained(dirs_of(runs)[base]).eval()
    with torch.no_grad():
        a, b, c = (m(ids).logits for m in (merged, adapted, plain))
    between = float((a - b).abs().max())
    print(f"{name}: merged export self-check {diffs['merged']:.2e}, adapter export self-check {diffs['adapter']:.2e}, "
          f"merged vs PeftModel on the base {between:.2e}, vs the base alone {float((a - c).abs().max()):.2e}")
    assert diffs["merged"] <= 1e-5 and diffs["adapter"] <= 1e-5 and between <= 1e-5
    assert float((a - c).abs().max()) > 1e-2  # the adapters are in the export


def test_adapter_export_of_a_full_fine_tune_is_one_line(runs, tmp_path):
    code, _, err = _export(runs / "full_z3", tmp_path / "a", "--adapter", check=False)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert naming(err, "--adapter", "lora.r=0", "without --adapter")


def _export(run: Path, out: Path, *extra: str, check: bool = True) -> tuple[int, str, str]:
    """`bigtrain export RUN --out OUT ...` in this process (the verb's own entry: parser, messages, exit code)."""
    from bigtrain.export.__main__ import main
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([str(run), "--out", str(out), *extra])
    assert code == 0 or not check, stderr.getvalue()[-3000:]
    return code, stdout.getvalue(), stderr.getvalue()


def _consolidated(run: Path, consolidate, build) -> dict[str, torch.Tensor]:
    state = json.loads((run / "checkpoints" / "step_000004" / "bigtrain.json").read_text())
    mb = state["model_build"]
    spec = build(mb["family"], mb["size"], **mb["overrides"])
    found = consolidate(run / "checkpoints" / "step_000004", spec, 1)
    return {n: t.contiguous() for n, t in found.tensors.items()}


@pytest.mark.parametrize("extra", [["--adapter", "--force"], ["--force"]], ids=["adapter", "merged"])
def test_an_export_onto_the_base_it_reads_is_refused_and_the_base_is_kept(runs, extra):
    """--force replaces a folder; the run's own base model directory is one the user saved (and the adapter export
    loads on it), so an --out that is that directory is one line, and its files stay."""
    base = dirs_of(runs)["llama"]
    before = sorted(p.name for p in base.iterdir())
    code, _, err = _export(runs / "z3", base, *extra, check=False)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert naming(err, "--out", "base model", str(base.resolve()), "choose another directory")
    assert sorted(p.name for p in base.iterdir()) == before
