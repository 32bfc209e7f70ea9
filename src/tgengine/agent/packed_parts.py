"""Weights packed as an update's parts arrive, while the weights sleep at level 2.

With the weights released, an update's parts would otherwise wait whole until the commit and
the wakeup, then be packed: the parts and the packed weights side by side, twice the weights.
Here each linear weight whose packed form takes rows (pair panels) is written into its new
packed form as its part arrives (``PendingPanels.absorb``), and the part can go: the peak is
the weights plus one part. The update itself says which names it took
(``WeightUpdate``): a push cancelled or refused midway leaves rows written that no name
covers, and rows no name covers are never applied. At the commit the covered groups become
``StagedPanels`` for the wakeup (``install_staged_panels``), or, if the weights woke
meanwhile, are applied at once (``apply_pending``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequestError
from ..kernels.pair_panels import empty_pair_panels, write_pair_panel_rows
from ..models import CausalLM
from ..models.gemm import LinearWeights, Panels
from ..models.weights import copy_weights

Named = list[tuple[str, torch.Tensor]]


@dataclass
class PanelGroup:
    """New pair panels for one linear weight, and which of its parameters they hold."""

    weights: LinearWeights
    panels: torch.Tensor
    shapes: list[torch.Size]  # each parameter's local shape
    covered: set[int] = field(default_factory=set)

    @property
    def rows(self) -> int:
        return self.row0(len(self.shapes))

    def row0(self, index: int) -> int:
        return sum(int(s[0]) for s in self.shapes[:index])

    def dense(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s plain value, read back from the panels."""
        row0 = self.row0(index)
        return self.packed().rows_at(torch.arange(row0, row0 + int(self.shapes[index][0])))

    def packed(self) -> Panels:
        """The panels as the weight's packed form."""
        return Panels(self.panels, self.rows, pair_cols=int(self.shapes[0][1]))

    @property
    def complete(self) -> bool:
        return len(self.covered) == len(self.shapes)


class PendingPanels:
    """The open update's packed rows, by linear weight; names pushed map to (group, index)."""

    def __init__(self) -> None:
        self.groups: dict[int, PanelGroup] = {}
        self._owners: dict[str, tuple[LinearWeights, int]] | None = None
        self._names: dict[int, str] = {}  # parameter id -> name

    def absorb(self, model: CausalLM, shapes: dict[str, torch.Size], named: Named) -> list[str]:
        """Write every tensor of ``named`` that belongs to a pair-panel weight into its new
        panels; the names taken. ``InvalidRequestError`` for a tensor not finite (the
        rows written are then covered by no name)."""
        owners = self._owners_of(model)
        taken: list[str] = []
        for name, tensor in named:
            owner = owners.get(name)
            if owner is None:
                continue
            weights, index = owner
            group = self.groups.get(id(weights))
            if group is None:
                local = [shapes[self._names[id(p)]] for p in weights.params]
                rows = sum(int(s[0]) for s in local)
                panels = empty_pair_panels(rows, int(local[0][1]))
                group = self.groups[id(weights)] = PanelGroup(weights, panels, local)
            if tuple(tensor.shape) != tuple(group.shapes[index]):
                continue  # a shard to cut: the plain path takes it
            if not write_pair_panel_rows(group.panels, tensor.detach(), group.row0(index)):
                raise InvalidRequestError("weights", f"{name!r} holds a NaN or an infinity")
            taken.append(name)
        return taken

    def take(self, names: Iterable[str], model: CausalLM) -> list[PanelGroup]:
        """The groups with ``names`` marked covered (every other row is not); empties this."""
        owners = self._owners_of(model)
        for name in names:
            weights, index = owners[name]
            self.groups[id(weights)].covered.add(index)
        groups = [g for g in self.groups.values() if g.covered]
        self.clear()
        return groups

    def clear(self) -> None:
        self.groups.clear()
        self._owners = None

    def _owners_of(self, model: CausalLM) -> dict[str, tuple[LinearWeights, int]]:
        if self._owners is None:
            ids = self._names = {id(p): name for name, p in model.named_parameters()}
            self._owners = {}
            for weights in model.linear_weights():
                if (
                    model.gemm.packed_form(
                        weights.dtype, weights.device, rows_read=weights.rows_read
                    )
                    != "pairs"
                ):
                    continue
                for index, p in enumerate(weights.params):
                    self._owners[ids[id(p)]] = (weights, index)
        return self._owners


def merge_groups(staged: dict[int, PanelGroup], groups: list[PanelGroup]) -> None:
    """Add committed ``groups`` to ``staged`` (a later value of a parameter wins)."""
    for group in groups:
        old = staged.get(id(group.weights))
        if old is None or group.complete:
            staged[id(group.weights)] = group
            continue
        for index in group.covered:
            write_pair_panel_rows(old.panels, group.dense(index), old.row0(index))
        old.covered |= group.covered


def dense_named(model: CausalLM, groups: list[PanelGroup]) -> Named:
    """The covered parameters' plain values, by name (for a path that takes tensors)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [(names[id(g.weights.params[i])], g.dense(i)) for g in groups for i in sorted(g.covered)]


def install_staged_panels(
    model: CausalLM, staged: dict[int, PanelGroup], plain: dict[int, torch.Tensor]
) -> None:
    """At a level-2 wakeup: each staged group's panels become its weight; its parameters
    not covered take their values from ``plain`` (by parameter id: staged after the panels,
    or read from the model directory), written into the panels. Consumes ``staged``."""
    for group in staged.values():
        weights = group.weights
        params = weights.params
        rest = [(i, plain[id(p)]) for i, p in enumerate(params) if i not in group.covered]
        model.gemm.install(weights, group.packed())
        for index, value in rest:
            model.gemm.write_rows(weights, index, value)
    staged.clear()


def apply_pending(model: CausalLM, groups: list[PanelGroup]) -> None:
    """Apply committed groups to resident weights: a complete group's panels replace the
    weight's packed form; a partial one's rows are written into it."""
    rest: list[PanelGroup] = []
    for group in groups:
        weights = group.weights
        packed = weights.packed
        if group.complete and isinstance(packed, Panels) and packed.pair_cols is not None:
            model.gemm.drop(weights)
            model.gemm.install(weights, group.packed())
        else:
            rest.append(group)
    copy_weights(model, dense_named(model, rest))
