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
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from packfunc.compat import context
from packfunc.engine.api import BatchRecord, SiteConsumer, narrowest

if TYPE_CHECKING:
    from packfunc.compat.context import Context

Shapes = dict[int, tuple[int, ...]]
"""Each site's output shape ``[N, ...]``."""

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
    rounding: torch.dtype | None = None
    """The narrowest dtype the forward computed in (autocast's), if narrower than theirs."""

    @staticmethod
    def note(into: dict[int, Fingerprint], k: int, g: Tensor | None) -> None:
        """Keep the fingerprint of site ``k``'s cotangent ``g`` (``None``: no gradient)."""
        with torch.no_grad():
            into[k] = torch.zeros(()) if g is None else torch.linalg.vector_norm(g.detach())

    def watching(
        self, record: BatchRecord, edges: dict[int, GradientEdge], shapes: Shapes
    ) -> BatchRecord:
        """``record`` with pullbacks that note each site's cotangent of the loss gradient.

        Only pullbacks of the record's own ``∂L/∂output`` are noted (a second-order pass
        pulls back other columns too).

        Args:
            record: A batch record pulling back through the user's graph.
            edges: Its sites' output edges in that graph.
            shapes: Its sites' output shapes (the pullbacks give them so already).

        Returns:
            The record, its pullbacks noting what they give each site.
        """
        self.edges = dict(edges)

        def of_the_loss_gradient(cotangent: Tensor) -> bool:
            return _of_the_loss_gradient(watched_ref, cotangent)

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
                k
                for k in self.users
                if bool(_differ(self.ours[k] * scale, self.users[k], self.rounding))
            ]
            if differing:
                refuse(differing)

        torch.autograd.Variable._execution_engine.queue_callback(compare)

    def _users(self, k: int, at: int, grad_outputs: tuple[Tensor | None, ...]) -> None:
        """A node pre-hook: note the user's backward pass's cotangent of site ``k``."""
        if not context.in_own_pass():
            self.note(self.users, k, grad_outputs[at])


def _differ(ours: Fingerprint, users: Fingerprint, rounding: torch.dtype | None = None) -> Tensor:
    """Whether two cotangents' norms differ beyond rounding (a boolean tensor).

    The same nodes compute both from the same gradient: they agree to rounding unless a
    term reached the site besides the output's gradient (a term ``p`` moves the squared
    norm by ``2⟨g, p⟩ + ‖p‖²``). Rounding is a thousand of the dtype's epsilon (float32:
    1.2e-4 of the squared norm, float64: 2.2e-13), and at least eight of the narrower one's
    (a bfloat16 cotangent of the user's autocast backward against packfunc's float32:
    6 %; they differed by 0.9 %, and ClippedGrad was refused at random), or of
    ``rounding``, the dtype autocast computed the forward in (float32 cotangents of
    bfloat16 ops: GPT-2's differed by 5e-4).

    Example:
        >>> bool(_differ(torch.tensor(2.0), torch.tensor(2.0))), bool(
        ...     _differ(torch.tensor(2.0), torch.tensor(2.1)))
        (False, True)
    """
    dtypes = [ours.dtype, users.dtype, *([rounding] if rounding is not None else [])]
    narrower = narrowest(*dtypes)
    tolerance = max(
        1000 * torch.finfo(torch.promote_types(ours.dtype, users.dtype)).eps,
        8 * torch.finfo(narrower).eps,
    )
    a, b = ours.double().square(), users.double().square().to(ours.device)
    return (a - b).abs() > tolerance * torch.maximum(a, b)


def first_order_only(ctx: Context | None) -> bool:
    """Whether ``ctx``'s extensions are first-order statistics of the loss gradient alone.

    ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared``, ``Variance``, without module
    extensions: the layers' cotangents of the user's backward pass are all they need.
    """
    return ctx is not None and all(
        not ext.job().second_order
        and ext.job().computes_statistic
        and not getattr(ext, "module_extensions", None)
        for ext in ctx.extensions
    )


@dataclass
class TakenCotangents:
    """The cotangents the user's latest backward pass brought a watched forward's calls.

    Hooks on the calls' autograd nodes, registered when the forward is recorded, keep them
    in a backward pass that first-order extensions alone take them from (see
    :func:`first_order_only`): a layer whose node runs before the model output's (one
    computed after the output, feeding another loss term) is taken too.

    Attributes:
        task: The backward pass (graph task) they come from.
        found: ``(id of the node, output index)`` -> cotangent (``None``: no gradient).
        hooked: Whether the calls' nodes were hooked.

    Example:
        >>> taken = TakenCotangents()
        >>> taken.take(7, 0, (torch.ones(2),))  # outside backpack(...): nothing kept
        >>> taken.found
        {}
    """

    task: int = -1
    found: dict[tuple[int, int], Tensor | None] = field(default_factory=dict)
    hooked: bool = False

    def hook(self, edges: list[GradientEdge]) -> None:
        """Hook the nodes of ``edges`` (the watched calls' outputs)."""
        for edge in edges:
            edge.node.register_prehook(partial(self.take, id(edge.node), edge.output_nr))
        self.hooked = True

    def take(self, node: int, at: int, grad_outputs: tuple[Tensor | None, ...]) -> None:
        """A node pre-hook: keep the cotangent where first-order extensions alone run."""
        if context.in_own_pass() or torch.is_grad_enabled():  # (create_graph: not taken)
            return
        if not first_order_only(context.active()):
            return
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task, self.found = task, {}
        g = grad_outputs[at]
        self.found[node, at] = None if g is None else g.detach()


@dataclass
class UsersCotangents:
    """Each site's output cotangent taken from the user's own backward pass.

    First-order extensions need the cotangents of the loss gradient only, which the user's
    backward pass computes anyway: hooks on the sites' autograd nodes take them as it goes
    (:class:`TakenCotangents`), and the extensions run at its end (see
    :func:`~packfunc.compat.run.run_extensions`). Nothing of the user's graph runs twice, so
    hooks on layers inside the model (a full backward hook, a tensor's hook) run once, and a
    loss term on an activation inside the model is part of the cotangents, as in BackPACK's
    first-order results.

    Attributes:
        taken: What the hooks on the forward's calls took.
        edges: The autograd edge of each site's output in the user's graph.
        shapes: Each site's output shape ``[N, ...]``.

    Example:
        >>> users = UsersCotangents(TakenCotangents())
        >>> users.edges
        {}
    """

    taken: TakenCotangents
    edges: dict[int, GradientEdge] = field(default_factory=dict)
    shapes: Shapes = field(default_factory=dict)
    _at_output: set[int] = field(default_factory=set)
    _capturing: bool = True

    def watching(
        self, record: BatchRecord, edges: dict[int, GradientEdge], shapes: Shapes
    ) -> BatchRecord:
        """``record`` whose pullbacks of the loss gradient give the cotangents taken.

        Args:
            record: A batch record of the user's graph.
            edges: Its sites' output edges in that graph.
            shapes: Their output shapes.

        Returns:
            The record; a pullback of another cotangent is the record's own.
        """
        self.edges, self.shapes = dict(edges), dict(shapes)

        def pullback(cotangent: Tensor) -> dict[int, Tensor]:
            if not (self._capturing and _of_the_loss_gradient(watched_ref, cotangent)):
                return record.pullback(cotangent)
            return self.handed(cotangent, None, last=False)

        def last_pullback(cotangent: Tensor, consume: SiteConsumer | None) -> dict[int, Tensor]:
            if not (self._capturing and _of_the_loss_gradient(watched_ref, cotangent)):
                return record.last_pullback(cotangent, consume)
            return self.handed(cotangent, consume, last=True)

        watched = dataclasses.replace(record, pullback=pullback, last_pullback=last_pullback)
        watched_ref = weakref.ref(watched)
        return watched

    def capture(self, output: GradientEdge) -> bool:
        """Whether the running backward pass brings every site's cotangent to the hooks.

        Args:
            output: The model output's edge (a site there takes the output's gradient).

        Returns:
            ``False`` where the forward's calls were not hooked, or a site's node does not
            run in this backward pass (``backward(inputs=...)`` leaves it out).
        """
        task = torch._C._current_graph_task_id()
        if self.taken.task != task:  # (no site's node has run yet in this backward pass)
            self.taken.task, self.taken.found = task, {}
        self._at_output = {k for k, edge in self.edges.items() if _same_edge(edge, output)}
        hooked = [k for k in self.edges if k not in self._at_output]
        self._capturing = self.taken.hooked and all(
            torch._C._will_engine_execute_node(self.edges[k].node) for k in hooked
        )
        return self._capturing

    def stop_capturing(self) -> None:
        """Let the pullbacks of the loss gradient run through the user's graph themselves.

        For a backward pass that does not bring every site's cotangent (see :meth:`capture`)
        or is not used: the sites it leaves out got zeros from :meth:`handed`.
        """
        self._capturing = False

    def handed(
        self, cotangent: Tensor, consume: SiteConsumer | None, last: bool
    ) -> dict[int, Tensor]:
        """The cotangents taken, each passed through ``consume``, as a pullback gives them.

        Args:
            cotangent: The output's gradient (the cotangent of a site at the output's node).
            consume: What keeps each site's cotangent, or ``None`` (all kept).
            last: Whether they are let go as they are handed (no pullback follows).

        Returns:
            Site -> what is kept of its cotangent.
        """
        found: dict[int, Tensor] = {}
        for k, edge in self.edges.items():
            key = (id(edge.node), edge.output_nr)
            held = self.taken.found.pop(key, None) if last else self.taken.found.get(key)
            g = cotangent if k in self._at_output else held
            g = g.reshape(self.shapes[k]) if g is not None else cotangent.new_zeros(self.shapes[k])
            kept = g if consume is None else consume(k, g)
            if kept is not None:
                found[k] = kept
        return found


def _same_edge(a: GradientEdge, b: GradientEdge) -> bool:
    return a.node is b.node and a.output_nr == b.output_nr


def _of_the_loss_gradient(watched_ref: weakref.ref[BatchRecord], cotangent: Tensor) -> bool:
    """Whether ``cotangent`` is the watched record's own ``∂L/∂output``.

    (The record is held weakly: it holds the pullbacks that ask, a cycle that would keep its
    recorded inputs until the garbage collector ran.)
    """
    found = cast(BatchRecord, watched_ref()).__dict__.get("_loss_and_cotangent")
    return found is not None and _same_tensor(cotangent, found[1])


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is ``b`` or a view of all of it (``b[None][0]``)."""
    try:
        same_memory = a.data_ptr() == b.data_ptr()
    except RuntimeError:  # (a functorch wrapper has no storage to compare)
        return False
    return same_memory and a.shape == b.shape and a.stride() == b.stride()
