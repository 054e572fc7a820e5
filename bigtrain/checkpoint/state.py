"""`CheckpointState`: what a checkpoint records beside DeepSpeed's files, typed and versioned.

It lives in the tag directory's `bigtrain.json` marker (written last, see `store`). Resume reads
the step, data position and loss history; `universal` reads the shape it was saved at; export
reads how to rebuild the model and where the run's tokenizer is.

Paths are stored relative, so a run folder that is moved or copied still resumes and exports:
`run_dir` relative to the tag directory (`../..` for RUN/checkpoints/step_N), `tokenizer_dir`
relative to the run directory. In memory both are absolute, resolved from where the checkpoint
is now. `saved_run_dir`, where the run was when it saved, is only a fallback: a tag directory
copied out on its own still finds the run's tokenizer while the run is where it was.

Layout versions: 1 is what bigtrain wrote before the marker had a version (absolute tokenizer
path); it is converted on reading. 2 is the current one. Anything else is refused with one line.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSION = 2
OLDEST = 1  # markers without a "version" key: bigtrain before this module existed
MARKER = "bigtrain.json"


@dataclass(frozen=True)
class ModelBuild:
    """How to rebuild the trained model: `bigtrain.models.build(family, size, **overrides)`."""

    family: str
    size: str
    overrides: dict = field(default_factory=dict)
    hub: dict | None = None  # a Hub model.pretrained: {repo_id, revision, commit} (`bigtrain.models.hub`)

    def to_json(self) -> dict:
        out = {"family": self.family, "size": self.size, "overrides": dict(self.overrides)}
        return {**out, "hub": dict(self.hub)} if self.hub else out

    def here(self) -> "ModelBuild":
        """This build with its pretrained directory on this machine: a Hub model's snapshot that is not here (an
        export on another machine, a cleaned cache) is fetched again at the commit the run trained from."""
        pretrained = self.overrides.get("pretrained")
        if not self.hub or not pretrained or Path(pretrained).is_dir():
            return self
        from bigtrain.models.hub import resolve_model_dir
        found = resolve_model_dir(self.hub["repo_id"], self.hub["commit"])
        return ModelBuild(self.family, self.size, {**self.overrides, "pretrained": found.path}, self.hub)


@dataclass(frozen=True)
class CheckpointState:
    """The bigtrain side of one checkpoint (DeepSpeed's files hold the tensors)."""

    step: int
    world_size: int
    pipeline_stages: int = 1
    data: dict = field(default_factory=dict)  # the sampler's state_dict: the data position
    losses: list[float] = field(default_factory=list)  # one per step from step 1
    history: dict = field(default_factory=dict)
    """The run's other curves up to this step ([step, value] lists: val_losses, val_accuracies, router_aux_losses)
    and wall_s, the run's seconds so far: a resumed run's summary continues them."""
    model_build: ModelBuild | None = None
    run_config: dict = field(default_factory=dict)  # bigtrain.config.load.to_dict of the run's config
    ds_config: dict = field(default_factory=dict)  # the DeepSpeed config it trained with
    run_dir: Path | None = None  # the run's --out directory (absolute in memory)
    tokenizer_dir: Path | None = None  # the tokenizer the run trained, if it trained one (absolute in memory)
    # how its data put prompts to the model (bigtrain.data.formats.prompt_rendering: "chat_template" or "text"; None:
    # unknown), which `bigtrain generate` and `chat` follow
    prompts: str | None = None
    version: int = VERSION

    def to_json(self, tag_dir: Path) -> dict:
        """The marker's content for a checkpoint written to `tag_dir`: paths made relative."""
        run_dir = _relative(self.run_dir, Path(tag_dir)) if self.run_dir else None
        tokenizer = _relative(self.tokenizer_dir, self.run_dir) if self.tokenizer_dir and self.run_dir else None
        if self.tokenizer_dir and not self.run_dir:
            tokenizer = str(Path(self.tokenizer_dir).resolve())
        return {"version": VERSION, "step": self.step, "world_size": self.world_size,
                "pipeline_stages": self.pipeline_stages, "data": self.data, "losses": list(self.losses),
                "history": dict(self.history),
                "model_build": self.model_build.to_json() if self.model_build else None,
                "run_config": self.run_config, "ds_config": self.ds_config,
                "run_dir": run_dir, "tokenizer_dir": tokenizer, "prompts": self.prompts,
                "saved_run_dir": str(Path(self.run_dir).resolve()) if self.run_dir else None}

    @classmethod
    def from_json(cls, raw: dict, tag_dir: Path) -> "CheckpointState":
        """The state of the checkpoint in `tag_dir` from its marker's content; ValueError (one line) for a
        layout this bigtrain does not read."""
        where = Path(tag_dir) / MARKER
        version = raw.get("version", OLDEST)
        if not isinstance(version, int) or isinstance(version, bool) or version < OLDEST:
            raise ValueError(f"{where}: unknown checkpoint layout version {version!r} (this bigtrain reads "
                             f"{OLDEST}-{VERSION}); it was not written by bigtrain")
        if version > VERSION:
            raise ValueError(f"{where}: checkpoint layout version {version} is newer than this bigtrain reads "
                             f"({OLDEST}-{VERSION}); upgrade bigtrain to resume or export it")
        if version == 1:
            raw = _from_v1(raw, Path(tag_dir))
        missing = [key for key in ("step", "world_size") if key not in raw]
        if missing:
            raise ValueError(f"{where} has no {' or '.join(missing)}; the marker is damaged (or not bigtrain's)")
        run_dir = _resolve(Path(tag_dir), raw.get("run_dir"))
        return cls(step=int(raw["step"]), world_size=int(raw["world_size"]),
                   pipeline_stages=int(raw.get("pipeline_stages") or 1), data=raw.get("data") or {},
                   losses=[float(x) for x in raw.get("losses") or []], history=raw.get("history") or {},
                   model_build=_model_build(raw.get("model_build")), run_config=raw.get("run_config") or {},
                   ds_config=raw.get("ds_config") or {}, run_dir=run_dir,
                   tokenizer_dir=_tokenizer(raw.get("tokenizer_dir"), run_dir, raw.get("saved_run_dir")),
                   prompts=raw.get("prompts"))


def read_state(tag_dir: str | Path) -> CheckpointState:
    """The state in `tag_dir`'s marker (the caller checked that the marker exists and is JSON)."""
    tag_dir = Path(tag_dir).resolve()
    return CheckpointState.from_json(json.loads((tag_dir / MARKER).read_text()), tag_dir)


def _from_v1(raw: dict, tag_dir: Path) -> dict:
    """Version 1 stored the tokenizer as the absolute (or cwd-relative) path `OUT/tokenizer` and no
    run directory. With the default checkpoint directory the run is two levels up from the tag,
    wherever it is now; with `checkpoint.dir` set elsewhere, the run is the recorded out dir."""
    run_config = raw.get("run_config") or {}
    out_dir = (run_config.get("train") or {}).get("out_dir")
    if not (run_config.get("checkpoint") or {}).get("dir"):
        run_dir: str | None = os.path.join("..", "..")
    elif out_dir and Path(out_dir).is_absolute():
        run_dir = out_dir
    else:
        run_dir = None  # a relative out dir of a job started from an unknown working directory
    tokenizer = raw.get("tokenizer_dir")
    saved_run_dir = str(Path(tokenizer).parent) if tokenizer and Path(tokenizer).is_absolute() else None
    if tokenizer and run_dir is not None and Path(tokenizer).name == "tokenizer":
        tokenizer = "tokenizer"  # version 1 always trained it into OUT/tokenizer
    return {**raw, "version": VERSION, "run_dir": run_dir, "tokenizer_dir": tokenizer,
            "saved_run_dir": saved_run_dir}


def _tokenizer(stored: str | None, run_dir: Path | None, saved_run_dir: str | None) -> Path | None:
    """The tokenizer under the run where it is now; else where it was when saved, if still there."""
    here = _resolve(run_dir or Path.cwd(), stored)
    if here is None or here.is_dir() or not saved_run_dir:
        return here
    before = _resolve(Path(saved_run_dir), stored)
    return before if before is not None and before.is_dir() else here


def _model_build(raw: Any) -> ModelBuild | None:
    if not isinstance(raw, dict) or not {"family", "size"} <= set(raw):
        return None
    hub = raw.get("hub") if isinstance(raw.get("hub"), dict) else None
    return ModelBuild(str(raw["family"]), str(raw["size"]), dict(raw.get("overrides") or {}), hub)


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(Path(path).resolve(), Path(start).resolve())


def _resolve(base: Path, stored: str | None) -> Path | None:
    if stored is None:
        return None
    return Path(os.path.normpath(Path(base) / stored))  # absolute stays absolute
