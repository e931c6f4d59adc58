"""BackPACK-compatible shim: existing BackPACK code runs on packfunc.

Replace the import prefix ``backpack`` with ``packfunc.compat``::

    from packfunc.compat import backpack, extend
    from packfunc.compat.extensions import BatchGrad

    model, lossfunc = extend(model), extend(lossfunc)
    loss = lossfunc(model(X), y)
    with backpack(BatchGrad()):
        loss.backward()
    model[0].weight.grad_batch  # [N, *weight.shape]
"""

from packfunc.compat.context import backpack, disable
from packfunc.compat.extend import extend

__all__ = ["backpack", "disable", "extend"]
