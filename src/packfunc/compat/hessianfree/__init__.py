"""Matrix-free curvature products built from plain ``torch.autograd`` calls.

Jacobian, transposed-Jacobian, Hessian and generalized Gauss-Newton products that
act on an autograd graph the caller has already built (BackPACK's ``hessianfree``).
"""
