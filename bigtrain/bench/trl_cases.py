"""What `bigtrain bench --trl` trains: one small Llama, one data set per objective and one set of settings, each
given to bigtrain and to TRL's own trainer (SFTTrainer, DPOTrainer, GRPOTrainer) in its own words.

`Settings` holds every setting that changes what a step computes or costs; `bigtrain_sets` and `trl_config` turn
it into `bigtrain train --set` overrides and TRL's config arguments. Settings neither side is given keep each
side's default only where the two defaults agree (TRL's are written beside each field); the result of every job
records the settings its trainer actually ran with (`baseline_trl.effective_settings`, bigtrain's summary.json),
and the page prints both sides' side by side (`trl_report.settings_table`).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

OBJECTIVES = ("sft", "dpo", "grpo")
RUNNERS = ("bigtrain", "trl")
# The model: a Llama 4 layers x 256 wide (random weights, seed 0), the chat BPE of bench.chat_data; a dry run's
# (`bigtrain bench --trl --dry-run`: the code paths, 3 steps) is 2 x 64 on a 512-token BPE.
SHAPE = {"hidden": 256, "layers": 4, "heads": 4, "kv": 2, "ffn": 704, "seq": 512}
VOCAB = 4096
DRY_SHAPE = {"hidden": 64, "layers": 2, "heads": 2, "kv": 1, "ffn": 128, "seq": 512}
DRY_VOCAB, DRY_STEPS = 512, 3


@dataclass(frozen=True)
class Settings:
    """One objective's settings, the same on both sides (TRL's names in the comments)."""

    steps: int = 12  # max_steps
    micro_batch: int = 8  # per_device_train_batch_size (rows; DPO: pairs; GRPO: completions)
    grad_accum: int = 2  # gradient_accumulation_steps
    lr: float = 1e-5  # learning_rate, constant (lr_scheduler_type constant, no warm-up)
    betas: tuple[float, float] = (0.9, 0.999)  # adam_beta1, adam_beta2 (TRL's defaults)
    eps: float = 1e-8  # adam_epsilon
    weight_decay: float = 0.0  # weight_decay
    grad_clip: float = 1.0  # max_grad_norm
    seed: int = 1  # seed
    max_length: int = 256  # SFT / DPO: max_length (both keep a longer record's first tokens); GRPO: prompt + completion
    beta: float = 0.0  # DPO: beta (TRL's 0.1); GRPO: beta (TRL's 0.0)
    num_generations: int = 8  # GRPO
    max_completion_length: int = 48  # GRPO
    temperature: float = 1.0  # GRPO
    loss_type: str = "dapo"  # GRPO (TRL's default); DPO: sigmoid, TRL's default and bigtrain's dpo
    epsilon: float = 0.2  # GRPO

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum


SETTINGS = {"sft": Settings(),
            "dpo": Settings(micro_batch=4, beta=0.1),
            "grpo": Settings(steps=8, micro_batch=16, max_length=96)}


@dataclass(frozen=True)
class Workload:
    """The files every job reads, made once per bench run (`make_workload`)."""

    base: Path  # the Llama directory (weights, tokenizer with its chat template)
    chats: Path  # SFT: {"messages": [...]} records
    pairs: Path  # DPO: {"prompt", "chosen", "rejected"} records, conversational
    prompts: Path  # GRPO: {"prompt", "answer"} arithmetic questions (bench.online.write_prompts)

    def data(self, objective: str) -> Path:
        return {"sft": self.chats, "dpo": self.pairs, "grpo": self.prompts}[objective]


def make_workload(root: Path, dry: bool = False) -> Workload:
    """The model and the three data sets under `root`: 600 chats of 8-120-word answers (6 longer than max_length, whose
    first tokens both sides keep: TRL's truncation_mode keep_start, bigtrain's data.long_examples=truncate), pairs
    made from them, 512 arithmetic prompts (a dry run: 100 and 64)."""
    from bigtrain.bench.chat_data import make_base, make_data, make_pairs
    from bigtrain.bench.online import write_prompts
    root.mkdir(parents=True, exist_ok=True)
    chats, tok = make_data(root, examples=100 if dry else 600, answer_words=(8, 120),
                           vocab_size=DRY_VOCAB if dry else VOCAB)
    base = make_base(root, tok, DRY_SHAPE if dry else SHAPE)
    prompts = write_prompts(root / "prompts.jsonl", 64 if dry else 512)
    end_completions_early(base, prompts)
    return Workload(base, chats, make_pairs(chats, root / "pairs.jsonl"), prompts)


ENDS_PER_TOKEN = 1 / 32  # the base's chance to end a completion at each token: about 4 in 5 end before 48 tokens


def end_completions_early(base: Path, prompts: Path, per_token: float = ENDS_PER_TOKEN) -> float:
    """Make the base end its sampled completions at mixed lengths, as a trained model does (random weights almost
    never draw their end-of-text, so every completion would run to max_completion_length and no generation would
    pay for padding): every token's embedding gets 1.0 in the first hidden channel, which then dominates that channel
    of the final norm's output everywhere; the output head reads that channel for the end-of-text alone, scaled so
    that its probability is about `per_token` at every position (measured on the prompts). Saved in place; returns
    the end-of-text's logit."""
    import json
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    assert not model.config.tie_word_embeddings, "the head must not be the embedding"
    tok = AutoTokenizer.from_pretrained(str(base), padding_side="left")
    batch = tok([json.loads(line)["prompt"] for line in prompts.read_text().splitlines()[:32]], return_tensors="pt",
                padding=True)
    eos, head = model.config.eos_token_id, model.get_output_embeddings().weight
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 1.0
        head[:, 0] = 0.0
        head[eos] = 0.0
        normed = model.model(**batch).last_hidden_state[batch["attention_mask"].bool()]
        others = torch.logsumexp(normed @ head.T, dim=-1).exp().mean() - 1.0  # the end-of-text's exp(0) left out
        logit = math.log(per_token / (1 - per_token) * float(others))
        head[eos, 0] = logit / float(normed[:, 0].mean())
    model.save_pretrained(str(base))
    return logit


@dataclass(frozen=True)
class Case:
    """One job: an objective trained by one runner; `setting` names a lever (bigtrain with `sets` / `flags`)."""

    objective: str
    runner: str
    settings: Settings
    setting: str = ""
    sets: tuple[tuple[str, str], ...] = field(default=())
    flags: tuple[str, ...] = ()  # bigtrain train's own arguments (a lever's)
    rep: int = 0  # which pair of the plan it belongs to

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES or self.runner not in RUNNERS:
            raise ValueError(f"bench case {self.objective}/{self.runner}: objectives {OBJECTIVES}, runners {RUNNERS}")

    @property
    def name(self) -> str:
        return f"{self.objective} {self.runner}" + (f" ({self.setting})" if self.setting else "")

    @property
    def slug(self) -> str:
        return "-".join(re.sub(r"[^\w.-]+", " ", self.name).split()) + f"-{self.rep}"


# bigtrain with one change against its defaults, run beside them: (name, --set overrides, bigtrain train arguments);
# ZERO3_LEVERS (GRPO at ZeRO-3, the weights gathered or left partitioned for generation) in full runs only
LEVERS = {
    "sft": (("rows padded to data.seq_len", (("data.padding", "max_length"),), ()),
            ("started through the deepspeed launcher", (), ("--launcher-arg=--master_addr=127.0.0.1",))),
    "grpo": (("transformers' generate (objective.decode=generate)", (("objective.decode", "generate"),), ()),
             ("a round for 2 steps (objective.steps_per_generation=4)", (("objective.steps_per_generation", "4"),),
              ())),
}
PARTITIONED = (("zero.stage", "3"), ("objective.ds3_gather_for_generation", "false"))
ZERO3_LEVERS = (("ZeRO-3, weights gathered for generation", (("zero.stage", "3"),
                                                              ("objective.ds3_gather_for_generation", "true")), ()),
                ("ZeRO-3, weights partitioned (compact, ranks in step)", PARTITIONED, ()),
                ("ZeRO-3, weights partitioned (HybridEngineRollout: decode=generate)",
                 (*PARTITIONED, ("objective.decode", "generate")), ()))


def plan(repeats: int = 3, only: str | None = None, dry: bool = False) -> list[Case]:
    """Every objective's bigtrain and TRL jobs, `repeats` pairs each, the pair's order alternating (A B, then B A)
    so that the machine's drift falls on both sides alike, each pair followed by the objective's levers (compared
    with that pair's bigtrain job); `only`: objectives whose name matches; `dry`: one pair of DRY_STEPS steps, no
    levers (each is a setting of the bigtrain job the pair runs; tests/unit/test_bench_trl.py holds their cases)."""
    cases = []
    for objective in OBJECTIVES:
        if only and not re.search(only, objective):
            continue
        settings = replace(SETTINGS[objective], steps=DRY_STEPS) if dry else SETTINGS[objective]
        for rep in range(1 if dry else repeats):
            pair = [Case(objective, "bigtrain", settings, rep=rep), Case(objective, "trl", settings, rep=rep)]
            levers = () if dry else (*LEVERS.get(objective, ()), *(ZERO3_LEVERS if objective == "grpo" else ()))
            cases += (pair if rep % 2 == 0 else pair[::-1]) + [
                Case(objective, "bigtrain", settings, name, sets, flags, rep) for name, sets, flags in levers]
    return cases


def bigtrain_sets(case: Case, work: Workload, out: Path) -> list[str]:
    """`bigtrain train` arguments for the case (one rank, the bench's own --out)."""
    s = case.settings
    sets: dict[str, Any] = {
        "model.pretrained": str(work.base), "precision": "fp32", "train.seed": s.seed, "optimizer.lr": s.lr,
        "optimizer.betas": f"[{s.betas[0]},{s.betas[1]}]", "optimizer.eps": s.eps,
        "optimizer.weight_decay": s.weight_decay, "optimizer.grad_clip": s.grad_clip,
        # a constant rate from the first step, as TRL's "constant" schedule: the warm-up starts at lr x 1.0
        "schedule.kind": "constant", "schedule.warmup_steps": 1, "schedule.min_lr_ratio": 1.0,
        "batch.micro_batch": s.micro_batch, "batch.grad_accum": s.grad_accum, "data.seq_len": s.max_length,
        # what TRL's jobs do not do either: no evaluation, no sample, no checkpoint; a log line per step
        "train.eval_interval": 0, "train.eval_batches": 0, "train.sample_tokens": 0, "checkpoint.at_end": "false",
        "logging.interval": 1, "logging.progress_bar": "false"}
    if case.objective == "sft":
        sets["data.train_on_prompt"] = "true"  # TRL trains a messages record on every token by default
    elif case.objective == "dpo":
        sets.update({"objective.kind": "dpo", "objective.beta": s.beta, "objective.reference": "copy"})
    else:
        sets.update({"objective.kind": "grpo", "objective.rewards": "accuracy", "objective.beta": s.beta,
                     "objective.num_generations": s.num_generations,
                     "objective.max_completion_length": s.max_completion_length,
                     "objective.temperature": s.temperature, "objective.loss_type": s.loss_type,
                     "objective.epsilon": s.epsilon})
    sets.update(dict(case.sets))
    args = ["--num-gpus", "1", *case.flags, "--model", "hf", "--data", str(work.data(case.objective)), "--steps",
            str(s.steps), "--out", str(out), "--overwrite"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


def trl_job(case: Case, work: Workload, out: Path) -> dict[str, Any]:
    """What bench.baseline_trl builds TRL's trainer from: the model, the data, the config's arguments."""
    s = case.settings
    config: dict[str, Any] = {
        "output_dir": str(out / "trl"), "use_cpu": True, "bf16": False, "fp16": False, "seed": s.seed,
        "max_steps": s.steps, "per_device_train_batch_size": s.micro_batch, "gradient_accumulation_steps": s.grad_accum,
        "learning_rate": s.lr, "adam_beta1": s.betas[0], "adam_beta2": s.betas[1], "adam_epsilon": s.eps,
        "weight_decay": s.weight_decay, "max_grad_norm": s.grad_clip, "lr_scheduler_type": "constant",
        "warmup_steps": 0, "logging_steps": 1, "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
        "dataloader_num_workers": 0}
    if case.objective in ("sft", "dpo"):
        config["max_length"] = s.max_length
    if case.objective == "dpo":
        config.update(beta=s.beta, loss_type=["sigmoid"])
    if case.objective == "grpo":
        config.update(beta=s.beta, num_generations=s.num_generations, max_completion_length=s.max_completion_length,
                      temperature=s.temperature, loss_type=s.loss_type, epsilon=s.epsilon)
    return {"objective": case.objective, "model": str(work.base), "data": str(work.data(case.objective)),
            "config": config, "rewards": ["bigtrain.rollout.builtin_rewards:accuracy"], "settings": asdict(s)}
