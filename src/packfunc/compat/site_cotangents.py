"""The check that a backward pass brings the model's layers no gradient beside its output's.

A loss term on an activation inside the extended model (a penalty on a hidden layer's
output that the forward keeps, a router's auxiliary loss) reaches the layers' outputs in
the user's backward pass without passing through the model's output. BackPACK's
first-order results include it (each module's ``grad_output``); the shim's come from
packfunc's pullback of the output's gradient, which does not see it: ``grad_batch`` would
hold the output's part alone and no longer sum to ``.grad``. So where the shim reuses the
user's forward, it notes a fingerprint of each layer's output cotangent in its pullback
and compares it, once the backward pass ends, with the one the user's backward pass gave
the same autograd node: a difference beyond rounding removes the results and refuses.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from packfunc.compat import context
from packfunc.engine.api import BatchRecord, SiteConsumer

Fingerprint = Tensor
"""A cotangent's norm (one pass over it: the check costs little beside the backward pass)."""


@dataclass
class SiteCotangents:
    """Each site's output cotangent in packfunc's pullback and in the user's backward pass.

    Attributes:
        edges: The autograd edge of each site's output in the user's graph.
        ours: Fingerprints of the cotangents packfunc's pullback gave each site.
        users: Those the user's backward pass gave the same nodes.

    Example:
        >>> check = SiteCotangents()
        >>> check.note(check.ours, 0, torch.ones(2, 3))
        >>> float(check.ours[0])
        2.4494898319244385
    """

    edges: dict[int, GradientEdge] = field(default_factory=dict)
    ours: dict[int, Fingerprint] = field(default_factory=dict)
    users: dict[int, Fingerprint] = field(default_factory=dict)
    scale: Tensor | None = None
    """What the user's backward pass multiplies packfunc's pullback by (a scaled loss, in a
    pass of the extended loss's own gradient); ``None``: one."""

    @staticmethod
    def note(into: dict[int, Fingerprint], k: int, g: Tensor | None) -> None:
        """Keep the fingerprint of site ``k``'s cotangent ``g`` (``None``: no gradient)."""
        with torch.no_grad():
            into[k] = torch.zeros(()) if g is None else torch.linalg.vector_norm(g.detach())

    def watching(self, record: BatchRecord, edges: dict[int, GradientEdge]) -> BatchRecord:
        """``record`` with pullbacks that note each site's cotangent of the loss gradient.

        Only pullbacks of the record's own ``∂L/∂output`` are noted (a second-order pass
        pulls back other columns too).

        Args:
            record: A batch record pulling back through the user's graph.
            edges: Its sites' output edges in that graph.

        Returns:
            The record, its pullbacks noting what they give each site.
        """
        self.edges = dict(edges)

        def of_the_loss_gradient(cotangent: Tensor) -> bool:
            # (weakly: the record holds these pullbacks, which would otherwise hold it, a
            # cycle that kept its recorded inputs until the garbage collector ran)
            found = cast(BatchRecord, watched_ref()).__dict__.get("_loss_and_cotangent")
            return found is not None and _same_tensor(cotangent, found[1])

        def pullback(cotangent: Tensor) -> dict[int, Tensor]:
            found = record.pullback(cotangent)
            if of_the_loss_gradient(cotangent):
                for k, g in found.items():
                    self.note(self.ours, k, g)
            return found

        def pullback_columns(cotangents: Tensor) -> dict[int, Tensor]:
            found = record.pullback_columns(cotangents)
            if len(cotangents) == 1 and of_the_loss_gradient(cotangents[0]):
                for k, g in found.items():
                    self.note(self.ours, k, g[0])
            return found

        def last_pullback(cotangent: Tensor, consume: SiteConsumer | None) -> dict[int, Tensor]:
            if not of_the_loss_gradient(cotangent):
                return record.last_pullback(cotangent, consume)

            def noted(k: int, g: Tensor) -> Tensor | None:
                self.note(self.ours, k, g)
                return g if consume is None else consume(k, g)

            return record.last_pullback(cotangent, noted)

        watched = dataclasses.replace(
            record,
            pullback=pullback,
            pullback_columns=pullback_columns,
            last_pullback=last_pullback,
        )
        watched_ref = weakref.ref(watched)
        return watched

    def check_after_backward(
        self, output_node: object, refuse: Callable[[list[int]], None]
    ) -> None:
        """Compare each site's cotangents once the running backward pass ends.

        Hooks on the sites' nodes note what the user's backward pass brings them; at its
        end they go, and ``refuse(sites)`` is called with the sites whose cotangents
        differ beyond rounding. A site at the output's own node, or not reached, is not
        compared.

        Args:
            output_node: The autograd node of the model's output (its gradient is the
                pullback's start).
            refuse: Called with the differing sites.
        """
        handles = []
        for k, edge in self.edges.items():
            if k not in self.ours or edge.node is output_node:
                continue
            handles.append(edge.node.register_prehook(partial(self._users, k, edge.output_nr)))

        def compare() -> None:
            for handle in handles:
                handle.remove()
            scale = 1.0 if self.scale is None else self.scale.abs().reshape(())
            differing = [
                k for k in self.users if bool(_differ(self.ours[k] * scale, self.users[k]))
            ]
            if differing:
                refuse(differing)

        torch.autograd.Variable._execution_engine.queue_callback(compare)

    def _users(self, k: int, at: int, grad_outputs: tuple[Tensor | None, ...]) -> None:
        """A node pre-hook: note the user's backward pass's cotangent of site ``k``."""
        if not context.in_own_pass():
            self.note(self.users, k, grad_outputs[at])


def _differ(ours: Fingerprint, users: Fingerprint) -> Tensor:
    """Whether two cotangents' norms differ beyond rounding (a boolean tensor).

    The same nodes compute both from the same gradient: they agree to rounding unless a
    term reached the site besides the output's gradient (a term ``p`` moves the squared
    norm by ``2⟨g, p⟩ + ‖p‖²``). Rounding is a thousand of the dtype's epsilon (float32:
    1.2e-4 of the squared norm, float64: 2.2e-13).

    Example:
        >>> bool(_differ(torch.tensor(2.0), torch.tensor(2.0))), bool(
        ...     _differ(torch.tensor(2.0), torch.tensor(2.1)))
        (False, True)
    """
    tolerance = 1000 * torch.finfo(torch.promote_types(ours.dtype, users.dtype)).eps
    a, b = ours.double().square(), users.double().square().to(ours.device)
    return (a - b).abs() > tolerance * torch.maximum(a, b)


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is ``b`` or a view of all of it (``b[None][0]``)."""
    try:
        same_memory = a.data_ptr() == b.data_ptr()
    except RuntimeError:  # (a functorch wrapper has no storage to compare)
        return False
    return same_memory and a.shape == b.shape and a.stride() == b.stride()
