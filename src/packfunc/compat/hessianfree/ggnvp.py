"""Generalized Gauss-Newton-vector products from autograd alone: ``Jᵀ H J v``."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.nn import Module

from .hvp import hessian_vector_product
from .lop import L_op
from .rop import R_op


def ggn_vector_product(
    loss: Tensor, output: Tensor, model: Module, v: Sequence[Tensor]
) -> tuple[Tensor, ...]:
    """Multiply ``v`` with the GGN of ``loss`` w.r.t. the model's trainable parameters.

    The trainable parameters are those of ``model.parameters()`` with
    ``requires_grad``; see :func:`ggn_vector_product_from_plist`.

    Args:
        loss: Scalar loss computed from ``output``.
        output: Model output the loss was computed from.
        model: The model that produced ``output``.
        v: One tensor per trainable parameter, shaped like it.

    Returns:
        ``G v`` as a tuple of tensors shaped like the trainable parameters.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> output = model(torch.ones(3, 2))
        >>> loss = torch.nn.MSELoss(reduction="sum")(output, torch.zeros(3, 1))
        >>> v = [torch.zeros(1, 2), torch.ones(1)]
        >>> ggn_vector_product(loss, output, model, v)
        (tensor([[6., 6.]]), tensor([6.]))
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ggn_vector_product_from_plist(loss, output, trainable, v)


def ggn_vector_product_from_plist(
    loss: Tensor, output: Tensor, plist: Sequence[Tensor], v: Sequence[Tensor]
) -> tuple[Tensor, ...]:
    """Multiply ``v`` with the GGN block of ``loss`` belonging to the tensors ``plist``.

    Computes ``Jᵀ H J v``, where ``J`` is the Jacobian of ``output`` w.r.t. ``plist``
    and ``H`` the Hessian of ``loss`` w.r.t. ``output``. The graph is kept alive.

    Args:
        loss: Scalar loss computed from ``output``.
        output: Tensor computed from ``plist``.
        plist: Tensors (usually parameters) that span the GGN block.
        v: One tensor per entry of ``plist``, shaped like it.

    Returns:
        ``G v`` as a tuple of tensors shaped like ``plist``.

    Example:
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> output = w * torch.tensor([3.0, 4.0])
        >>> loss = (output**2).sum()
        >>> ggn_vector_product_from_plist(loss, output, [w], [torch.ones(2)])
        (tensor([18., 32.]),)
    """
    jv = R_op(output, plist, v)
    hjv = hessian_vector_product(loss, output, jv)
    return L_op(output, plist, hjv)
