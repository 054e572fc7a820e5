"""The seam between the stepper and an objective: what an objective declares it needs (`Needs`), the settings it
owns, what it may ask of the model it trains (`Policy`), and the per-step contract (`Objective`).

Imported by the run config (the declarations and settings), which loads without torch: nothing here imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping, Protocol

if TYPE_CHECKING:
    import torch

Metrics = dict[str, Any]  # detached scalar tensors on the device, averaged over micro-batches and ranks

REFERENCES = ("adapters_off", "copy", "precomputed")  # the kinds of frozen reference (objective.reference)
LIVE_REFERENCES = ("adapters_off", "copy")  # a forward pass beside the policy's at every step
# What a run may switch on that an objective can refuse (`Needs.refuses`): train.compile, train.loss_impl=chunked,
# data.packing, pipeline stages, tensor and sequence parallelism, batch.micro_batch=auto.
MODES = ("compile", "chunked_loss", "packing", "pipeline", "tensor", "sequence", "auto_micro_batch")
LIMITS = ("micro_batch", "samples_per_record", "completion_tokens")  # `Needs.refuses` says why each holds
HEADS = ("own", "scalar")  # the model's own output head, or a one-label scalar head (a sequence classifier)


@dataclass(frozen=True)
class FrozenModel:
    """A frozen model an objective holds beside the policy (a reward model, a teacher): the setting of the
    objective's own that names its Hugging Face directory, and the head it is loaded with. The builder makes it
    (partitioned like the policy under ZeRO-3), `Policy.frozen(setting)` runs it, the estimate counts it."""

    setting: str
    head: str = "own"

    def directory(self, settings: Any) -> str | None:
        """Where this model comes from, from the objective's settings: the one place its setting is read (the
        builder and the estimate both ask here); None when the setting is left unset (no model)."""
        return getattr(settings, self.setting)


LORA_RATE_FACTOR = 10.0  # TRL's PEFT guide (docs/source/peft_integration.md): LoRA at about 10 x the full rate


@dataclass(frozen=True)
class FineTuning:
    """What an objective trains a pretrained model with when the run sets none (bigtrain.config.defaults reads it;
    docs/fine-tuning.md has the table beside TRL's): the peak learning rate of full weights (TRL's trainer's default
    for the objective), of LoRA adapters (None: 10 x lr, TRL's PEFT guide), the weight decay (TRL's: 0), Adam's betas
    (TRL's and the HF Trainer's: 0.9, 0.999) and the warm-up steps (TRL's: none, the peak rate from the first
    step)."""

    lr: float
    lora_lr: float | None = None
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        assert self.lr > 0 and (self.lora_lr is None or self.lora_lr > 0), self
        assert self.weight_decay >= 0 and self.warmup_steps >= 0, self

    def rate(self, lora: bool) -> float:
        """The peak learning rate: with LoRA adapters `lora_lr`, else `lr`."""
        if not lora:
            return self.lr
        return self.lora_lr if self.lora_lr is not None else LORA_RATE_FACTOR * self.lr


@dataclass(frozen=True, kw_only=True)
class Needs:
    """What an objective needs of a run. The config rules, lint, `bigtrain estimate`, the launcher's memory check,
    the builder and the job read it; none of them names an objective."""

    layout: str = "rows"  # the data it reads (bigtrain.data.dataset.LAYOUTS): rows, pairs, unpaired
    rows_per_sample: int = 1  # rows a sample puts through the policy in one micro-batch
    references: tuple[str, ...] = ()  # the reference kinds it may compare with (REFERENCES); () uses none
    generates: bool = False  # samples completions from the policy before its loss (`Policy.generate`)
    own_prompts: bool = False  # makes its prompts itself where no data is given (an environment's reset)
    frozen_models: tuple[FrozenModel, ...] = ()  # extra frozen models held beside the policy
    head: str = "own"  # the policy's head (HEADS)
    dropout: bool = True  # False: the policy's dropout is switched off (its forward passes are compared)
    min_micro_batch: int = 1  # the least batch.micro_batch it trains with (why: refuses["micro_batch"])
    # samples one data record becomes (GRPO: a prompt's num_generations completions): each rank's samples per step
    # (micro x accumulation) must hold whole records, read once a step (`Objective.data_batch`)
    samples_per_record: int = 1
    samples_setting: str = ""  # the setting that decides samples_per_record (objective.num_generations), if one does
    completion_tokens: int = 0  # tokens of data.seq_len its generated completions take (its prompts get the rest)
    # at ZeRO-3, whether a generation round gathers the whole weights on each device: True, False (partitioned), or
    # "auto" (where they fit: bigtrain.rollout.generate.gather_choice); the estimate counts them
    gathers_weights: bool | str = False
    # why it cannot run with each MODE it refuses; also why a reference kind it does not allow cannot serve it, and
    # (keys "micro_batch", "samples_per_record", "completion_tokens") why those limits hold
    refuses: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.rows_per_sample >= 1 and self.samples_per_record >= 1 and self.head in HEADS, self
        assert set(self.references) <= set(REFERENCES), self.references
        assert set(self.refuses) <= {*MODES, *REFERENCES, *LIMITS}, sorted(self.refuses)

    def allows(self, mode: str) -> bool:
        assert mode in MODES, mode
        return mode not in self.refuses


@dataclass(kw_only=True)
class NoSettings:
    """An objective without settings of its own."""


class Policy(Protocol):
    """What the stepper hands an objective (`bigtrain.train.policy.PolicyModel`): the model being trained and the
    frozen models beside it. An objective asks nothing else of the engine."""

    device: str
    tokenizer: Any  # the run's tokenizer (None for models trained without one)
    seed: int  # train.seed: an objective's own random streams start from it

    def inputs(self, rows: dict) -> tuple[Any, torch.Tensor]:
        """Rows of a batch as the model's inputs and labels, on the device."""

    def to_device(self, value: Any) -> Any:
        """Tensors (in a dict, tuple or list) on the device; floating ones in the engine's dtype."""

    def logits(self, inputs: Any) -> torch.Tensor:
        """The policy's output logits (a scalar head's are [rows, 1]), with their graph."""

    def sequence_slice(self, inputs: Any, labels: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Under sequence parallelism this rank's slice of each row (inputs with their positions, labels whose
        next-token targets are the slice's), which `forward_with_loss` then takes; the rows unchanged without it."""

    def forward_with_loss(self, inputs: Any, labels: torch.Tensor,
                          scale: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
        """The model's own loss of a micro-batch, by the route the engine was built with (plain, chunked, compiled,
        sequence-parallel; a mixture of experts' router term added, and reported as `router_aux_loss`). `scale`:
        `token_scale`'s factor."""

    def eval_with_loss(self, inputs: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """(loss, its weight in the evaluation's mean, metrics) of a held-out micro-batch by the same route; a
        classifier also counts its correct predictions (`correct`, `predictions`)."""

    def token_scale(self, labels: list[torch.Tensor]) -> torch.Tensor | None:
        """For data whose rows train different numbers of tokens (chat, instruction): the factor that makes the
        step's loss the mean over all its trained tokens; None where every micro-batch weighs alike."""

    def answer_logps(self, inputs: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: the policy's summed log-probability of its answer tokens (labels not -100), with its graph, and
        how many there are."""

    def reference_logps(self, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """Per row: the same sum under the frozen reference (objective.reference), without a graph."""

    def completion_logits(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                          completion_mask: torch.Tensor, pixels: Any = None) -> torch.Tensor:
        """[N, C, V]: the policy's logits that predict each completion token (`bigtrain.rollout.forward`), with their
        graph: left-padded prompts, right-padded completions (`pixels`: a vision-language model's images of the
        rows)."""

    def reference_completion_logits(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                                    completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                                    pixels: Any = None) -> torch.Tensor:
        """The same under the frozen reference (objective.reference), without a graph."""

    def frozen(self, setting: str) -> Any:
        """The frozen model declared as `FrozenModel(setting)`: `.logits(inputs)` and `.completion_logits(...)`
        without a graph, `.ds` (its forward-only engine, called like a transformers model), `.directory`."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Any, rng: Any, *,
                 gather: bool | None = None, logps: bool = False, pixels: Any = None) -> Any:
        """Completions sampled from the policy for left-padded prompts, every rank calling it together: a
        `bigtrain.rollout.generate.Rollout` drawn with `Sampling` from the objective's own `SampleRNG` (with the
        sampling distribution's log-probabilities when `logps`). `gather`: at ZeRO-3, the weights gathered once
        for the round (True) or left partitioned (False); None: gathered where they fit one device
        (`bigtrain.rollout.generate.gather_choice`), as `choose_gather("auto")` decided. `pixels`: a
        vision-language model's images of the prompts, repeated for their completions (the Rollout's `pixels`)."""

    def choose_gather(self, setting: str | bool) -> str:
        """objective.ds3_gather_for_generation (auto, true, false) decided for the run, every rank calling it
        together at the start; the start line's words for the decision and why ('' below ZeRO-3)."""

    def stop_ids(self) -> list[int]:
        """The token ids a completion ends at: the tokenizer's end-of-text and any the model's generation_config
        lists."""


class Objective:
    """One training objective. Per optimizer step the stepper calls `inputs` on each of the step's batches, then
    `begin_step` on them all (whatever they share: a token count, completions and their rewards), then
    `micro_loss` on each, and steps backward on the loss it returns; in evaluation `eval_loss` per batch.

    A subclass declares `needs`, its `Settings` (a keyword-only dataclass, each field written with
    `bigtrain.fields.doc`), its `fine_tuning` defaults and a one-line `summary`; `declare` may make the needs depend
    on the settings."""

    needs: ClassVar[Needs] = Needs()
    fine_tuning: ClassVar[FineTuning | None] = None  # every objective declares its own (tests/unit/test_defaults.py)
    Settings: ClassVar[type] = NoSettings
    summary: ClassVar[str] = ""  # what a step minimises, for objective.kind's help
    samples: ClassVar[str] = "samples"  # what one sample is, in the job's start line

    def __init__(self, kind: str, settings: Any = None, reference: str = "none"):
        self.kind = kind
        self.settings = NoSettings() if settings is None else settings
        self.reference = reference  # resolved: none | adapters_off | copy | precomputed

    @classmethod
    def declare(cls, settings: Any) -> Needs:
        """What this objective needs with these settings (override where they decide it: a reference only when
        a KL term is on, say)."""
        return cls.needs

    def inputs(self, policy: Policy, batch: dict) -> Any:
        """A batch on the device, in the form `micro_loss` takes."""
        return policy.inputs(batch)

    def data_batch(self, micro_batch: int, micro_batches: int) -> int:
        """Records per batch this objective reads from the data for a step of `micro_batches` micro-batches of
        `micro_batch` samples (in evaluation, `micro_batches` 1): a micro-batch's by default."""
        return micro_batch

    def eval_data_batch(self, micro_batch: int) -> int:
        """Records per held-out batch (one micro-batch of `micro_batch` samples): as a step of one micro-batch
        reads by default."""
        return self.data_batch(micro_batch, 1)

    def step_batches(self, micro_batches: int) -> int:
        """How many of the data's batches make one step whose rows the data may regroup by length where it cuts
        batches to their longest row (`bigtrain.data.loader.by_length`: a batch of short rows then runs short): 1,
        none, by default; an objective whose step loss and gradient are the same however the step's rows are cut
        into equal micro-batches gives `micro_batches`."""
        return 1

    def read_step(self, policy: Policy, batches: Iterator[dict], micro_batches: int) -> list[Any]:
        """The step's micro-batches, each in the form `micro_loss` takes: by default `micro_batches` batches read
        from `batches` through `inputs`. An objective may read otherwise: one batch of prompts whose completions
        make the whole step (online RL), or none while it steps again over what it holds (num_iterations)."""
        return [self.inputs(policy, next(batches)) for _ in range(micro_batches)]

    def begin_step(self, policy: Policy, micro: list[Any]) -> Any:
        """Whatever the step's micro-batches share; None by default."""
        return None

    def end_step(self, policy: Policy, step: Any) -> Metrics:
        """After the step's optimizer update: metrics of the whole step (not averaged over its micro-batches; then
        averaged over the ranks like the others). Metrics named `time/PART` are the seconds of the step spent in
        PART: the summary adds their mean and share (`bigtrain.train.report`)."""
        return {}

    def sample_settings(self) -> Any:
        """How the end-of-run sample answers its held-out prompt (`bigtrain.train.sample`): an objective that
        generates gives its own `bigtrain.rollout.generate.Sampling`, as it trained; None: train.sample_tokens
        tokens, top-k 40."""
        return None

    def window_warning(self) -> str | None:
        """At each log step, on every rank alike: one warning about the steps since the last log step (online RL:
        a collapse, `bigtrain.rollout.collapse`), or None (the default)."""
        return None

    def sample_table(self) -> list[dict] | None:
        """Rows this rank shows of its last step (online RL: prompts, completions, rewards), or None. Rank 0's go
        to OUT/samples.jsonl and to the trackers that take tables at every log step."""
        return None

    def state_dict(self) -> dict:
        """This rank's own state for a checkpoint (tensors and plain values: an objective's random stream, what it
        holds between steps), saved beside the rank's RNG state; {} by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """What `state_dict` saved, on a resume at the same world size (at another, nothing is loaded)."""

    def micro_loss(self, policy: Policy, item: Any, step: Any) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    def eval_loss(self, policy: Policy, item: Any) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """(loss, its weight in the evaluation's mean, metrics) of one held-out batch, without gradients."""
        import torch
        loss, metrics = self.micro_loss(policy, item, None)
        return loss, torch.ones((), dtype=torch.float64, device=loss.device), metrics

    def flops_factor(self) -> float:
        """FLOPs per token against the policy's 6N training FLOPs per token: a live reference's forward pass adds
        a third (forward only), a precomputed one nothing."""
        return 1.0 + (1 / 3 if self.reference in LIVE_REFERENCES else 0.0)


def check_positive(settings: Any, *names: str, note: str = "") -> None:
    """Each of `names` of an objective's settings must be > 0 (one line naming objective.NAME if not)."""
    for name in names:
        if not getattr(settings, name) > 0:
            raise ValueError(f"objective.{name}={getattr(settings, name)}: must be > 0{note}")
