"""A run's mistakes that need no rank, found before any starts: `bigtrain train` checks in the launching process
before the launcher starts, and bigtrain/run.py before the process group when no launching process did (a direct
`deepspeed bigtrain/run.py`). Each check is the one the ranks run later, called from both places:

    the output folder   another job in it, an earlier run's checkpoints,   checkpoint.claim.run_dir_problem
                        --resume with none
    the model           a directory of another family, no trainable class  train.inputs.model_modality
                        a split the family has no mode for (pipeline,     parallel.split_rules.check_family_modes
                        tensor, sequence, expert)
    the data            its format, its first records read and rendered    data.peek
    objective x data    the layout the objective reads                     objectives.data_problem (job.py's)
    reward functions    a file's existence, syntax, the name in it         rollout.rewards.check_function_file
    tools, environments the files imported, each tool's schema, each       rollout.environments.Toolbox,
                        environment's reset, the chat template's tools,    rollout.tool_format.template_problem
                        the first records' environments
    evaluation tasks    names, the local task folder, the layout           eval.during_training.check_tasks
    the batch           at the world size the launcher starts: the         ds.groups.group_problem (job.py's)
                        DeepSpeed dict resolved (the triple, the lint),
                        whole groups of online RL's completions a rank

What needs the ranks stays with them: the DeepSpeed config on the ranks' own device, the checkpoint's bytes on --resume, a
hub source (but a Hub-shaped model name under a local folder, a mistyped directory most likely, is looked up in the
cache or on the Hub here: `models.hub.commit_of`, no download), a tokenizer still to be trained, a task's data.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from bigtrain.config.run_config import RunConfig

CHECKED_ENV = "BIGTRAIN_PRECHECKED"  # set by `bigtrain train` for its ranks: the launching process checked already


def check_run(run: RunConfig, *, resume: bool = False, overwrite: bool = False, world_size: int | None = None,
              ds_config: str | None = None, sources: Mapping[str, str] | None = None) -> None:
    """ValueError (one line, the ranks' own) for the first mistake found. `world_size`: the ranks the launcher will
    start (None: unknown, the batch is left to them), `ds_config` the user's DeepSpeed JSON, `sources` the fields
    the user gave (`config.flags.config_sources`)."""
    from bigtrain.checkpoint.claim import run_dir_problem
    out = Path(run.train.out_dir)
    problem = run_dir_problem(out, Path(run.checkpoint.dir or out / "checkpoints"), resume=resume, overwrite=overwrite)
    if problem:
        raise ValueError(problem)
    from bigtrain.models.hub import commit_of, is_hub_name, mistyped_directory
    from bigtrain.models.names import MODALITY, canonical
    from bigtrain.train.inputs import model_modality
    model = run.model
    on_hub = bool(model.pretrained) and (is_hub_name(model.pretrained) or model.revision is not None)
    if on_hub and is_hub_name(model.pretrained) and mistyped_directory(model.pretrained):
        # a Hub-shaped name under a local folder (exported/sfft beside exported/sft): most likely a typo, which the
        # ranks would find after the launcher's start; ask the cache or the Hub now (no download), as they would
        commit_of(model.pretrained, model.revision)
    if model.pretrained and not on_hub:  # a directory here: checked against --model (its family's own check)
        modality = model_modality(model)
    else:  # none, or a Hub name the ranks download (hf's data is then its config's: left to them)
        modality = MODALITY.get(canonical(model.family))
    from bigtrain.config.topology import Topology
    from bigtrain.parallel.split_rules import check_family_modes
    check_family_modes(model.family, Topology.of_run(run.parallel, run.pipeline.stages, world=0))
    own_prompts = run.objective.declared.own_prompts and run.data.source == "builtin"  # an environment's
    if modality == "text" and not own_prompts:
        check_text_data(run, tokenizer_here=not is_hub_name(run.data.tokenizer)
                        and (run.data.tokenizer is not None or not on_hub))
    elif modality == "vision" and not on_hub:
        check_vision_data(run)
    check_reward_functions(run)
    check_tools(run, tokenizer_here=not on_hub and not is_hub_name(run.data.tokenizer))
    check_frozen_models(run)
    from bigtrain.eval.during_training import check_tasks
    check_tasks(run)
    if world_size is not None:
        check_batch(run, world_size, ds_config, sources, resume_from=Path(run.checkpoint.dir or out / "checkpoints")
                    if resume else None)


def check_batch(run: RunConfig, world_size: int, ds_config: str | None, sources: Mapping[str, str] | None,
                resume_from: Path | None = None) -> None:
    """The DeepSpeed dict the ranks will resolve at `world_size` (the batch triple, the lint's device-free rules:
    this machine's kernels are the ranks' to judge), then whole groups of the objective's samples on every rank
    (`bigtrain.ds.groups`); on --resume with the newest checkpoint's global batch, which the ranks keep."""
    from bigtrain.ds.groups import group_problem
    from bigtrain.ds.lint import DeviceCaps
    from bigtrain.ds.resolve import resolve
    from bigtrain.distributed.device import accelerator_name
    resume_batch = _saved_batch(resume_from) if resume_from is not None else None
    if (name := accelerator_name()) is None:
        return  # DeepSpeed cannot tell the accelerator here: the ranks resolve and judge the batch themselves
    device = DeviceCaps(name, fp16=True, bf16=True)
    resolved = resolve(run, ds_config, world_size, device, sources=sources, resume_batch=resume_batch)
    if line := group_problem(run, ds_config, world_size, sources, resume_batch=resume_batch,
                             ds_config=resolved.ds_config, device=device):
        raise ValueError(line)


def _saved_batch(ckpt_dir: Path) -> int | None:
    """The global batch of the newest complete checkpoint (None: none, or one this bigtrain cannot read: the ranks
    say so)."""
    from bigtrain.checkpoint.state import read_state
    from bigtrain.checkpoint.store import newest_complete
    try:
        tag = newest_complete(ckpt_dir)
        return read_state(ckpt_dir / tag).ds_config.get("train_batch_size") if tag else None
    except (OSError, ValueError):
        return None


def check_reward_functions(run: RunConfig) -> None:
    """An online objective's reward functions given as files: each file there, parsing, defining the name (read,
    not imported: `rollout.rewards.check_function_file`)."""
    settings = run.objective.settings
    from bigtrain.rollout.builtin_rewards import builtin
    from bigtrain.rollout.rewards import check_function_file
    for spec in getattr(settings, "rewards", None) or []:
        if builtin(spec, settings.max_completion_length) is None and not Path(spec).expanduser().is_dir():
            check_function_file(spec)


def check_tools(run: RunConfig, tokenizer_here: bool = True) -> None:
    """objective.tools / objective.environment as the ranks load them (`rollout.environments.Toolbox`: the files
    imported, each tool's schema, each environment's reset); the chat template able to show calls and results and
    its calls readable (`rollout.tool_format.template_problem`, where the tokenizer is here); with several
    environments, the first records each naming one."""
    settings = run.objective.settings
    if not getattr(settings, "uses_tools", False):
        return
    from bigtrain.rollout.environments import Toolbox
    from bigtrain.rollout.tool_format import template_problem
    from bigtrain.train.inputs import default_tokenizer
    box = Toolbox(settings.tools or [], settings.environments)
    name = default_tokenizer(run.data, run.model) if tokenizer_here else None
    if name is not None:
        from bigtrain.data.tokenizer import load_tokenizer
        tok = load_tokenizer(name, run.data.chat_template)
        if problem := template_problem(tok):
            raise ValueError(f"objective.tools / objective.environment: {problem}")
    if box.named:
        for text, records in first_records(run):
            box.check_records(records, f"{text}: record")


def first_records(run: RunConfig) -> list[tuple[str, list]]:
    """(source text, its first records) of each local file of the run's records (data.peek's count)."""
    import itertools

    from bigtrain.data.formats import FIELDS
    from bigtrain.data.peek import PEEK_RECORDS, peek_source
    from bigtrain.data.prepare.pieces import iter_records
    from bigtrain.data.sources import Source
    from bigtrain.train.inputs import example_options
    data = run.data
    peek = peek_source(data.source, example_options(data, run.objective.declared), data.split, data.revision,
                       data.streaming)
    return [(text, list(itertools.islice(iter_records(part, tuple(FIELDS[fmt])), PEEK_RECORDS)))
            for text, part, fmt in (peek.parts if peek else [])
            if isinstance(part, Source) and part.kind == "files" and fmt in FIELDS]


def check_frozen_models(run: RunConfig) -> None:
    """The objective's frozen models (a teacher, a reward model): each directory there and of the right kind."""
    from bigtrain.models.hf_dir import frozen_model_problem
    for frozen in run.objective.declared.frozen_models:
        directory = frozen.directory(run.objective.settings)
        if directory is not None and (problem := frozen_model_problem(directory, frozen.setting, frozen.head)):
            raise ValueError(problem)


def check_text_data(run: RunConfig, tokenizer_here: bool = True) -> None:
    """The data source's format against the objective, then its first records (text data only). `tokenizer_here`:
    the run's tokenizer can be had without the ranks (not the Hub's: without it, records are read, not rendered)."""
    from bigtrain.data.peek import check_first_records, peek_source
    from bigtrain.train.inputs import default_tokenizer, example_options
    data = run.data
    options = example_options(data, run.objective.declared)  # the ranks' own: prompt records for an online objective
    if data.source == "synthetic":
        return
    peek = peek_source(data.source, options, data.split, data.revision, data.streaming)
    if peek is None:  # a hub source: the ranks stream it
        return
    check_objective_data(run, peek.layout, peek.plain, peek.keys)
    check_first_records(peek, default_tokenizer(data, run.model) if tokenizer_here else None, options,
                        seq_len=data.seq_len, val_fraction=data.val_fraction, text_field=data.text_field,
                        tokenizer_known=tokenizer_here)


def check_vision_data(run: RunConfig) -> None:
    """Records with images for a vision-language model: the source against the objective, the model's processor
    (`data.vision.vision_processor`: one source, no packing, records not plain text), and the first records rendered
    through it, their images opened."""
    from bigtrain.data.peek import check_first_images, peek_source
    from bigtrain.data.vision import vision_processor
    from bigtrain.train.inputs import default_tokenizer, example_options
    data = run.data
    options = example_options(data, run.objective.declared)
    peek = peek_source(data.source, options, data.split, data.revision, data.streaming) \
        if data.source not in ("synthetic", "builtin") else None
    if peek is None:  # a hub source (the ranks stream it), or no records at all (the ranks' data says so)
        return
    check_objective_data(run, peek.layout, peek.plain, peek.keys)
    processor = vision_processor([part for _, part, _ in peek.parts], [fmt for _, _, fmt in peek.parts],
                                 default_tokenizer(data, run.model), options)
    check_first_images(peek, processor)


def check_objective_data(run: RunConfig, layout: str, plain: bool, keys: list[str] | None = None) -> None:
    """The data's layout against the objective's (one line if not: `objectives.data_problem`, the job's own check).
    `keys`: the first record's, when the data is records of no format (`plain`): then the line names the fields
    they lack for the nearest format the objective reads (a record without `rejected`), not that they are text."""
    from bigtrain import objectives
    from bigtrain.data.dataset import LAYOUTS
    from bigtrain.data.formats import layout_formats, missing_fields
    kind, needs = run.objective.kind, run.objective.declared
    if layout == needs.layout or layout not in LAYOUTS or needs.layout not in LAYOUTS:
        return  # the same; or a layout the data layer itself refuses for this objective, on the ranks
    if plain and keys is not None and needs.layout != "rows":
        lacks = ", ".join(map(repr, missing_fields(keys, layout_formats(needs.layout))))
        raise ValueError(f"objective.kind={kind} trains on {LAYOUTS[needs.layout][1]}, and the records of this data "
                         f"have no {lacks} (the first has {sorted(keys)}): give every record {lacks}, or set "
                         "data.format to the format they hold")
    if problem := objectives.data_problem(kind, needs, layout, plain_text=plain):
        raise ValueError(problem)


def checked_by_launcher() -> bool:
    """Whether `bigtrain train` checked this run before starting this rank."""
    return os.environ.get(CHECKED_ENV) == "1"
