"""Backends for libraries built on curvature; each submodule imports its library on demand."""
