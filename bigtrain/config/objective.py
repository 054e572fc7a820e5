"""The run config's `objective` section, assembled from the table of objectives (`bigtrain.objectives.OBJECTIVES`):
`kind`, `reference`, and every objective's own settings side by side, one field per name (`--set
objective.beta=0.2`, `objective: {kind: dpo, beta: 0.2}`). A name several objectives' settings share is one field,
their texts joined; where their defaults differ, its default is None, which leaves each objective its own.

The section checks the kind's settings (its `Settings` dataclass) and the reference against what the kind declares
(`Needs.references`); the rules that join it with other sections read the same declaration
(`bigtrain.config.run_config.objective_problems`).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from bigtrain.fields import doc, field_doc
from bigtrain.objectives import OBJECTIVES, REFERENCES, Needs, objective_class

Kind = Literal[tuple(OBJECTIVES)]  # type: ignore[valid-type]
Reference = Literal[("auto", *REFERENCES, "none")]  # type: ignore[valid-type]


def _kinds_doc() -> str:
    kinds = "; ".join(f"{kind} = {cls.summary}" for kind, cls in OBJECTIVES.items())
    return (f"What a step minimises (bigtrain.objectives): {kinds}. Hyper-parameters keep TRL's meanings and "
            "defaults.")


def _reference_doc() -> str:
    compare = [k for k, cls in OBJECTIVES.items() if cls.needs.references]
    precomputed = [k for k, cls in OBJECTIVES.items() if "precomputed" in cls.needs.references]
    without = [k for k, cls in OBJECTIVES.items() if not cls.needs.references]
    return (f"The frozen reference {', '.join(compare)} compare with: adapters_off = the policy with its LoRA "
            "adapters switched off (no second copy; needs lora.r > 0); copy = a frozen second model partitioned "
            f"like the policy; precomputed = ({', '.join(precomputed)}) the reference's log-probabilities computed "
            "once before training by such a copy, which is then freed, kept beside the prepared data and reused by "
            f"later runs and resumes; auto = adapters_off with LoRA, else copy; none for objectives without one "
            f"({', '.join(without)}).")


@dataclass
class ObjectiveBase:
    """kind and reference; `ObjectiveConfig` adds the objectives' settings."""

    kind: Kind = doc(next(iter(OBJECTIVES)), _kinds_doc())
    reference: Reference = doc("auto", _reference_doc())

    def __post_init__(self) -> None:
        reference_problem(self.kind, self.declared, self.reference)

    @property
    def settings(self) -> Any:
        """The kind's own settings (its `Settings` dataclass, checked) from this section's fields."""
        cls = objective_class(self.kind).Settings
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in values.items() if value is not None or name not in SHARED})

    @property
    def declared(self) -> Needs:
        """What the kind needs with these settings."""
        return objective_class(self.kind).declare(self.settings)


def reference_problem(kind: str, needs: Needs, reference: str) -> None:
    """objective.reference against the kinds `kind` allows (one line if it cannot serve it)."""
    allowed = needs.references
    if not allowed and reference not in ("auto", "none"):
        why = f" ({needs.refuses[reference]})" if reference in needs.refuses else ""
        raise ValueError(f"objective.reference={reference}: objective.kind={kind} uses no reference model{why}; "
                         "leave objective.reference=auto")
    if allowed and reference == "none":
        raise ValueError(f"objective.kind={kind} compares with a reference model: set objective.reference to auto, "
                         f"{', '.join(allowed[:-1])} or {allowed[-1]}" if len(allowed) > 1 else
                         f"objective.kind={kind} compares with a reference model: set objective.reference to auto or "
                         f"{allowed[0]}")
    if allowed and reference not in ("auto", *allowed):
        why = needs.refuses.get(reference, "not supported")
        raise ValueError(f"objective.reference={reference} with objective.kind={kind}: {why}; use "
                         f"objective.reference={' or '.join(allowed)} (or auto)")


def _setting_fields() -> tuple[list[tuple[str, Any, Any]], set[str]]:
    """(name, type, field) of every objective's settings, each name once; and the names whose defaults differ."""
    owners: dict[str, list[tuple[list[str], dataclasses.Field, Any]]] = {}
    for settings in dict.fromkeys(cls.Settings for cls in OBJECTIVES.values()):
        kinds = [k for k, cls in OBJECTIVES.items() if cls.Settings is settings]
        hints = typing.get_type_hints(settings)
        for f in dataclasses.fields(settings):
            owners.setdefault(f.name, []).append((kinds, f, hints[f.name]))
    made, shared = [], set()
    for name, owned in owners.items():
        text = " ".join(dict.fromkeys(field_doc(f) for _, f, _ in owned))
        defaults = [f.default for _, f, _ in owned]
        hint = owned[0][2]
        assert all(h == hint for _, _, h in owned), f"objective.{name}: the objectives' settings give it other types"
        if len(set(map(repr, defaults))) == 1:
            made.append((name, hint, doc(defaults[0], text)))
            continue
        shared.add(name)
        each = "; ".join(f"{'/'.join(kinds)} {f.default!r}" for kinds, f, _ in owned)
        made.append((name, hint | None, doc(None, f"{text} Default: each objective's own ({each}).")))
    return made, shared


_FIELDS, SHARED = _setting_fields()
ObjectiveConfig = dataclasses.make_dataclass("ObjectiveConfig", _FIELDS, bases=(ObjectiveBase,),
                                             namespace={"__module__": __name__})
ObjectiveConfig.__doc__ = ("The objective a step minimises (objective.kind), its reference, and every objective's "
                           "own settings (bigtrain.objectives).")
