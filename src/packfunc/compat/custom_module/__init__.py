"""BackPACK's utility modules (``backpack.custom_module``), for models written with them.

BackPACK needs these modules to see branches, scalings, slices and permutations as
modules it has extension code for. packfunc differentiates any forward pass, so
they are plain ``nn.Module`` s with BackPACK's forward semantics and need no
extension code; a model built from them gives the same results as its plain
PyTorch version.
"""
