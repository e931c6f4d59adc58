"""BackPACK's ``core.derivatives`` paths that client code imports."""
