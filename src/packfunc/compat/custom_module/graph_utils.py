"""``BackpackTracer``: a ``torch.fx`` tracer that keeps BackPACK's utility modules whole."""

from __future__ import annotations

from torch import nn
from torch.fx import Tracer

from packfunc.compat.custom_module.branching import SumModule, _Branch
from packfunc.compat.custom_module.permute import Permute
from packfunc.compat.custom_module.reduce_tuple import ReduceTuple
from packfunc.compat.custom_module.scale_module import ScaleModule


class BackpackTracer(Tracer):
    """Trace a model, treating BackPACK's utility modules as leaves (single graph nodes).

    Example:
        >>> import torch
        >>> graph = BackpackTracer().trace(torch.nn.Sequential(ScaleModule(2.0), torch.nn.ReLU()))
        >>> [node.op for node in graph.nodes]
        ['placeholder', 'call_module', 'call_module', 'output']
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Whether ``m`` is one graph node: BackPACK's utility modules and torch's own."""
        if isinstance(m, (ScaleModule, SumModule, _Branch, ReduceTuple, Permute)):
            return True
        return super().is_leaf_module(m, module_qualified_name)
