"""Skip the docstring examples of integrations whose library is not installed."""

import importlib.util

collect_ignore: list[str] = [] if importlib.util.find_spec("laplace") else ["laplace.py"]
