"""BackPACK-compatible shim: existing BackPACK code runs on packfunc.

Replace the import prefix ``backpack`` with ``packfunc.compat``::

    from packfunc.compat import backpack, extend
    from packfunc.compat.extensions import BatchGrad

    model, lossfunc = extend(model), extend(lossfunc)
    loss = lossfunc(model(X), y)
    with backpack(BatchGrad()):
        loss.backward()
    model[0].weight.grad_batch  # [N, *weight.shape]

Libraries that ``import backpack`` themselves run on the shim after
``alias_backpack()``.
"""

from packfunc.compat._stored_io import memory_cleanup, stored_io
from packfunc.compat.alias import BackpackAlias, alias_backpack
from packfunc.compat.context import backpack, disable
from packfunc.compat.distributed import all_reduce_extensions
from packfunc.compat.extend import extend

__all__ = [
    "BackpackAlias",
    "alias_backpack",
    "all_reduce_extensions",
    "backpack",
    "disable",
    "extend",
    "memory_cleanup",
    "stored_io",
]
