"""Which checkpoint to export: a run's out dir, its checkpoint dir, or one step_NNNNNN dir.

Forgiving about what the user points at, strict about what gets exported: only a tag
directory with its completion marker (`bigtrain.json`), never a half-written save.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bigtrain.checkpoint.state import CheckpointState, read_state
from bigtrain.checkpoint.integrity import damaged_files
from bigtrain.checkpoint.store import MARKER, TAG_RE, check_complete, find_resumable, tag_for

WHERE = "give a run's --out directory, its checkpoints/ directory, or one step_NNNNNN directory"


@dataclass(frozen=True)
class Located:
    """One complete checkpoint: CKPT_DIR/TAG and the state its marker holds."""

    ckpt_dir: Path
    tag: str
    state: CheckpointState

    @property
    def tag_dir(self) -> Path:
        return self.ckpt_dir / self.tag


def locate_checkpoint(path: str | Path, tag: str | None = None) -> Located:
    """Resolve `path` (+ optional `tag`, "step_000120" or "120") to one complete checkpoint.

    ValueError with one line naming the problem: a missing directory, no complete
    checkpoint, an incomplete tag, a marker of a layout version this bigtrain does not read,
    or a marker without what export needs.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory; {WHERE}")
    if TAG_RE.match(path.name) or (path / MARKER).is_file():
        if tag is not None and _normal_tag(tag) != path.name:
            raise ValueError(f"{path} is checkpoint {path.name} but --tag {tag} was given; drop one of them")
        return _complete(path.parent, path.name)
    ckpt_dir = _checkpoint_dir(path)
    if tag is not None:
        return _complete(ckpt_dir, _normal_tag(tag))
    found = find_resumable(ckpt_dir)
    if found is None:
        raise ValueError(f"no complete checkpoint in {ckpt_dir} (a step_NNNNNN directory with {MARKER}); "
                         "did the run reach a checkpoint?")
    return _checked(Located(ckpt_dir, found[0], found[1]))


def _checkpoint_dir(path: Path) -> Path:
    """A run's out dir holds checkpoints/ (unless it holds tags itself)."""
    has_tags = any(p.is_dir() and TAG_RE.match(p.name) for p in path.iterdir())
    if not has_tags and (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def _normal_tag(tag: str) -> str:
    return tag_for(int(tag)) if str(tag).isdigit() else str(tag)


def _complete(ckpt_dir: Path, tag: str) -> Located:
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name))
        raise ValueError(f"no checkpoint {tag} in {ckpt_dir}; it has: {', '.join(tags) or 'none'}")
    problem = check_complete(tag_dir)
    if problem is not None:
        raise ValueError(f"checkpoint {tag_dir} is not complete: {problem}; export an earlier one (--tag)")
    damaged = damaged_files(tag_dir)
    if damaged:
        raise ValueError(f"checkpoint {tag_dir} is damaged: {', '.join(damaged[:3])} changed since it was saved (its "
                         "bytes no longer match the digest in the marker); export an earlier one (--tag)")
    return _checked(Located(ckpt_dir, tag, read_state(tag_dir)))


def _checked(found: Located) -> Located:
    if found.state.model_build is None:
        raise ValueError(f"{found.tag_dir / MARKER} has no model_build (family, size, overrides): it was written "
                         "by an older bigtrain; export needs it to rebuild the model")
    return found
