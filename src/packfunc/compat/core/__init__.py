"""BackPACK's ``core`` paths that client code imports (packfunc's core is ``packfunc.engine``)."""
