"""Vision-language models trained on real ranks (tests/local_vlm.py: LLaVA, Idefics3 and Gemma 3 built tiny from
transformers' configs, saved with their processors; records in TRL's vision formats with PNG images drawn here).

Two launches share the work (tests/dist_scripts/equiv_runs.py):
- 2 ranks at ZeRO-3, the vision tower partitioned and trained: each family's supervised fine-tuning, whose three
  step losses equal one process's within 1e-5; LoRA, whose checkpoint's own logits on prompts with images
  (tests/dist_scripts/vlm_checks.py) are what its merged export, read back by AutoModelForImageTextToText and
  AutoProcessor, and its adapter export, on its base through peft, give; DPO on pairs of answers to one image, whose
  first step equals a plain computation (ln 2, and the chosen answers' log-probabilities of the untrained model on
  the same pairs); GRPO on prompts with images, the reward function given the images as TRL gives them, whose first
  step's loss and entropy equal a plain computation on the completions the run drew;
- one process: the references, and the learning task: "how many dots" asked of images of 1-4 dots, which only the
  image answers; after fine-tuning, the export, scored through transformers' own class and processor, answers
  held-out images far above chance (1 in 4).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from launch import launch_jobs, summary
from local_vlm import DIGITS, FAMILIES, dots_image, dots_records, make_vlm_dir, write_images, write_jsonl, chat_records, noise_image

STEPS = 3
SEED = 1234
COMMON = ["--set", "precision=fp32", "--set", "logging.progress_bar=false", "--set", "train.sample_tokens=0",
          "--peak-tflops", "1", "--set", "train.eval_interval=0", "--set", "data.seq_len=96",
          "--set", f"train.seed={SEED}", "--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=1"]
REWARDS = '''import json, os
import torch.distributed as dist


def score(completions, completion_ids, images, id, trainer_state, **kwargs):
    """A score of each completion's tokens alone (deterministic, differing within a group), and a line per call
    saying what the function was given: the completions' tokens, the records' ids, the images' types and sizes."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    line = {"step": trainer_state.global_step, "completion_ids": completion_ids, "id": id,
            "images": [[[type(image).__name__, list(image.size)] for image in row] for row in images]}
    with open(os.path.join(os.environ["VLM_REWARD_LOG"], f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\\n")
    return [float(sum(ids) % 7) for ids in completion_ids]
'''


def model_args(model: Path, data: Path, steps: int = STEPS, *extra: str) -> list[str]:
    return ["--model", "vlm", "--set", f"model.pretrained={model}", "--data", str(data), "--steps", str(steps),
            *COMMON, *extra]


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm_training")
    dirs = {family: make_vlm_dir(root, family, seed=i) for i, family in enumerate(FAMILIES)}
    rng = np.random.default_rng(0)
    paths = write_images(root / "imgs", [noise_image(rng, (40 - i, 28 + i)) for i in range(8)])
    write_jsonl(root / "chat.jsonl", chat_records(paths, 40))
    train, _ = dots_records(root, 240, seed=0)
    write_jsonl(root / "dots.jsonl", train)
    write_pairs_and_prompts(root)
    dirs["rl"] = stopping_early(dirs["llava"], root / "llava_rl")
    (root / "rewards.py").write_text(REWARDS)
    (root / "reward_log").mkdir()
    sft = sets("batch.micro_batch=2", "batch.global_batch=4", "optimizer.lr=1e-3", "model.overrides.freeze_vision=false")
    z3 = sets("zero.stage=3")
    two = [{"name": f"z3_{f}", "args": model_args(dirs[f], root / "chat.jsonl", STEPS, *sft, *z3)} for f in FAMILIES]
    two += [{"name": "lora_z3", "args": model_args(dirs["llava"], root / "chat.jsonl", STEPS, *z3, *sets(
                "batch.micro_batch=2", "batch.global_batch=4", "lora.r=4", "optimizer.lr=3e-2"))},
            {"name": "logits", "call": "vlm_checks.run_logits"},
            {"name": "dpo_z3", "args": model_args(dirs["llava"], root / "pairs.jsonl", 2, *z3, *sets(
                "objective.kind=dpo", "batch.micro_batch=2", "batch.global_batch=4", "optimizer.lr=1e-3"))},
            {"name": "grpo_z3", "args": model_args(dirs["rl"], root / "prompts.jsonl", 1, *z3, *sets(
                "objective.kind=grpo", f"objective.rewards=[{root / 'rewards.py'}:score]", "objective.num_generations=2",
                "objective.max_completion_length=4", "batch.micro_batch=2", "batch.global_batch=4",
                "optimizer.lr=1e-3"))}]
    launch_jobs(root, two, num_ranks=2, name="two", VLM_REWARD_LOG=str(root / "reward_log"))
    one = [{"name": f"ref_{f}", "args": model_args(dirs[f], root / "chat.jsonl", STEPS, *sft)} for f in FAMILIES]
    one.append({"name": "learn", "args": model_args(dirs["llava"], root / "dots.jsonl", 150, *sets(
        "batch.micro_batch=8", "batch.global_batch=8", "optimizer.lr=5e-3", "data.val_fraction=0.02"))})
    launch_jobs(root, one, num_ranks=1, name="one")
    return root


def stopping_early(model: Path, out: Path) -> Path:
    """The model with a third of its vocabulary listed as end-of-text ids (its generation_config's eos_token_id, which
    generation stops at too): completions of 1 to 4 tokens, whose lengths differ, so that the first step's loss
    (minus the advantages weighed by each completion's tokens) is not 0 as it is for equal lengths."""
    import shutil
    shutil.copytree(model, out)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = list(range(30, 160))
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def write_pairs_and_prompts(root: Path) -> None:
    """Preference pairs (the right count chosen, a wrong one rejected) and GRPO prompts, on images of dots."""
    rng = np.random.default_rng(3)
    counts = [int(c) for c in rng.integers(1, 5, size=24)]
    paths = write_images(root / "dots_rl", [dots_image(c, rng) for c in counts])
    ask = [{"type": "image"}, {"type": "text", "text": "how many dots"}]
    pairs = [{"prompt": [{"role": "user", "content": ask}], "images": [p],
              "chosen": [{"role": "assistant", "content": [{"type": "text", "text": DIGITS[c]}]}],
              "rejected": [{"role": "assistant", "content": [{"type": "text", "text": DIGITS[c % 4 + 1]}]}]}
             for p, c in zip(paths, counts)]
    write_jsonl(root / "pairs.jsonl", pairs)
    write_jsonl(root / "prompts.jsonl", [{"prompt": [{"role": "user", "content": ask}], "images": [p],
                                          "answer": DIGITS[c], "id": i} for i, (p, c) in enumerate(zip(paths, counts))])


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_at_zero3_train_as_one_process(runs, family):
    one, two = summary(runs / f"ref_{family}"), summary(runs / f"z3_{family}")
    assert len(one["losses"]) == len(two["losses"]) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(one["losses"], two["losses"]))
    print(f"{family}: 2 ranks at ZeRO-3 vs 1 process, worst relative loss difference {worst:.2e} ({two['losses']})")
    assert worst <= 1e-5, (one["losses"], two["losses"])
    assert two["losses"][-1] < two["losses"][0]  # the steps moved the weights: the updates are compared too
    assert two["data"]["image_tokens_per_example"] > 0


def fixed_inputs(directory: Path) -> dict:
    from bigtrain.models.pixels import fixed_vision_inputs
    return fixed_vision_inputs(str(directory))


def test_lora_under_zero3_trains_and_its_exports_give_the_runs_logits(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from bigtrain.export import export_checkpoint
    ran = summary(runs / "lora_z3")
    assert ran["losses"][-1] < ran["losses"][0]
    trained = torch.load(runs / "logits" / "logits.pt")["logits"]  # the training engine's own, 2 ranks at ZeRO-3
    merged = export_checkpoint(runs / "lora_z3", tmp_path / "merged")
    adapter = export_checkpoint(runs / "lora_z3", tmp_path / "adapter", adapter=True)
    assert merged.max_logit_diff < 1e-4 and adapter.max_logit_diff < 1e-4
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")  # the export's own processor, as a user loads it
    assert type(processor).__name__ == "LlavaProcessor"
    inputs = fixed_inputs(tmp_path / "merged")
    base_dir = runs / "llava"
    with torch.no_grad():
        model = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
        got = model(**inputs).logits
        base = AutoModelForImageTextToText.from_pretrained(base_dir).eval()
        untrained = base(**inputs).logits
        on_base = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(**inputs).logits
    print(f"LoRA export vs the run's logits: merged {(got - trained).abs().max():.2e}, adapter "
          f"{(on_base - trained).abs().max():.2e}; the run moved them by {(trained - untrained).abs().max():.2e}")
    assert torch.allclose(got, trained, atol=1e-4) and torch.allclose(on_base, trained, atol=1e-4)
    assert (trained - untrained).abs().max() > 1e-2  # the adapters trained: the comparison is not of the base


def test_sft_learns_what_only_the_image_tells(runs, tmp_path):
    """The exported model, read back by transformers' own class and processor, answers "how many dots" on images it
    never saw: one answer in four is chance."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from bigtrain.export import export_checkpoint
    export_checkpoint(runs / "learn", tmp_path / "learned")
    held, counts = dots_records(tmp_path, 48, seed=9)
    processor = AutoProcessor.from_pretrained(tmp_path / "learned")
    processor.tokenizer.padding_side = "left"  # one batch of prompts for generate
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "learned").eval()
    texts = [processor.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=False) for r in held]
    images = [[Image.open(tmp_path / r["images"][0]).convert("RGB")] for r in held]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    answers = processor.tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    accuracy = sum(a.strip().startswith(DIGITS[c]) for a, c in zip(answers, counts)) / len(held)
    print(f"held-out accuracy after {len(summary(runs / 'learn')['losses'])} steps: {accuracy:.2f} (chance 0.25)")
    assert accuracy >= 0.6  # 0.79 here (38 of 48) after 150 steps and after 200


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row: the summed log-probability of its labelled tokens (labels[t] predicted at t - 1)."""
    targets = labels[:, 1:]
    logps = torch.log_softmax(logits[:, :-1].float(), -1)
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != -100)).sum(-1)


def test_dpo_with_images_on_two_ranks_starts_as_a_plain_computation(runs):
    """At step 1 the policy is its reference: the loss is ln 2, and the chosen answers' log-probabilities are those
    of the untrained model on the pairs each rank's sampler gives first (their images through the processor)."""
    from bigtrain.data import build_data
    from bigtrain.data.formats import ExampleOptions
    from bigtrain.data.pairs import flat_pairs
    from bigtrain.data.sampler import ResumableSampler
    from bigtrain.models import build
    ran = summary(runs / "dpo_z3")
    assert len(ran["losses"]) == 2 and abs(ran["losses"][0] - math.log(2)) < 1e-6
    data = build_data(str(runs / "pairs.jsonl"), "vision", seq_len=96, tokenizer=str(runs / "llava"),
                      tokenizer_dir=runs / "dpo_tok", cache_dir=runs / "dpo_cache", num_proc=1,
                      examples=ExampleOptions())
    spec = build("vlm", "custom", pretrained=str(runs / "llava"), seq_len=96)
    model = spec.build(seed=SEED).eval()
    chosen = []
    for rank in range(2):
        order = iter(ResumableSampler(len(data.train), rank, 2, SEED))
        batch = flat_pairs(data.train.take([next(order) for _ in range(2)]))
        inputs, labels = spec.batch_to_inputs(batch)
        with torch.no_grad():
            chosen.append(answer_logps(model(**inputs).logits, labels)[:2])
    expected = float(torch.cat(chosen).mean())
    got = ran["metrics"]["logps/chosen"][0][1]
    print(f"DPO step 1: logps/chosen {got:.6f}, plain {expected:.6f}")
    assert abs(got - expected) < 1e-4 * abs(expected)


def test_grpo_with_image_prompts_on_two_ranks_starts_as_a_plain_computation(runs):
    """The reward function gets each completion's record's images, opened (TRL's `images=`); the first step's loss
    (dapo, ratio 1: minus the advantages averaged over the step's tokens) and entropy equal a plain computation over
    the completions the ranks drew, the untrained model reading the prompts with their images (transformers'
    apply_chat_template and processor)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    ran = summary(runs / "grpo_z3")
    calls = [json.loads(line) for rank in range(2)
             for line in (runs / "reward_log" / f"rank{rank}.jsonl").read_text().splitlines()]
    first = [c for c in calls if c["step"] == 0]
    assert len(first) == 2 and all(kind == "Image" and size for c in first for row in c["images"]
                                   for kind, size in row)
    records = {r["id"]: r for r in map(json.loads, (runs / "prompts.jsonl").read_text().splitlines())}
    processor = AutoProcessor.from_pretrained(runs / "llava_rl")
    model = AutoModelForImageTextToText.from_pretrained(runs / "llava_rl").eval()
    rewards, lengths, entropy = [], [], []
    for call in first:
        for ids, rid in zip(call["completion_ids"], call["id"]):
            record = records[rid]
            image = Image.open(runs / record["images"][0]).convert("RGB")
            text = processor.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=False)
            prompt = processor(text=[text], images=[[image]], return_tensors="pt")
            full = torch.cat([prompt["input_ids"], torch.tensor([ids])], 1)
            with torch.no_grad():
                logits = model(input_ids=full, pixel_values=prompt["pixel_values"]).logits[0, -len(ids) - 1:-1]
            p = torch.softmax(logits.double(), -1)
            entropy.append(-(p * p.clamp(min=1e-30).log()).sum(-1))
            rewards.append(float(sum(ids) % 7))
            lengths.append(len(ids))
    groups = torch.tensor(rewards, dtype=torch.float64).view(-1, 2)  # the two completions of each prompt
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
    n = torch.tensor(lengths, dtype=torch.float64)
    loss = float(-(advantages * n).sum() / n.sum())
    mean_entropy = float(torch.cat(entropy).mean())
    print(f"GRPO step 1: loss {ran['losses'][0]:.6f} (plain {loss:.6f}), entropy "
          f"{ran['metrics']['entropy'][0][1]:.6f} (plain {mean_entropy:.6f})")
    assert len(set(lengths)) > 1 and abs(loss) > 1e-3  # completions of several lengths: a loss other than 0
    assert abs(ran["losses"][0] - loss) < 1e-5
    assert abs(ran["metrics"]["entropy"][0][1] - mean_entropy) < 1e-4
