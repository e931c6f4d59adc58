"""The base class of every extension: a savefield, options, and custom module extensions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from packfunc.specs import Family, Quantity


@dataclass(frozen=True)
class Job:
    """What packfunc computes for an extension.

    Attributes:
        quantity: The quantity's spec (its family says which function computes it).
        options: Keyword arguments for the functional call.
        second_order: Whether the loss function (not only its gradient) is needed.
    """

    quantity: Quantity
    options: tuple[tuple[str, Any], ...] = ()
    second_order: bool = True

    @property
    def name(self) -> str:
        """The quantity's name (that of its public function)."""
        return self.quantity.name

    @property
    def computes_statistic(self) -> bool:
        """Whether it is a statistic of column gradients (one batch pass serves them all)."""
        return self.quantity.family is Family.STATISTIC


@dataclass
class BackpropExtension:
    """Base class of the extensions passed to ``with backpack(...)``.

    Args:
        savefield: Attribute of each parameter the result is stored in.
        subsampling: Sample indices for per-sample quantities (``None``: all).
    """

    savefield: str
    subsampling: list[int] | None = None
    module_extensions: dict[type, Any] = field(default_factory=dict, repr=False)

    def set_module_extension(
        self, module: type[nn.Module], extension: Any, overwrite: bool = False
    ) -> None:
        """Use ``extension`` for modules of class ``module`` instead of packfunc's own rules.

        Args:
            module: A module class.
            extension: An object with a method per parameter name (and, for second-order
                extensions, ``backpropagate``) called with BackPACK's arguments.
            overwrite: Replace an existing registration for ``module``.

        Raises:
            ValueError: if ``module`` already has an extension and ``overwrite`` is False.

        Example:
            >>> ext = BackpropExtension("grad_batch")
            >>> ext.set_module_extension(torch.nn.Linear, object())
        """
        if module in self.module_extensions and not overwrite:
            raise ValueError(
                f"{module.__name__} already has an extension for {self.savefield}; "
                "pass overwrite=True to replace it."
            )
        self.module_extensions[module] = extension

    def get_subsampling(self) -> list[int] | None:
        """Return the sample indices this extension is restricted to (``None``: all)."""
        return self.subsampling

    def job(self) -> Job:
        """Return what packfunc computes for this extension."""
        raise NotImplementedError
