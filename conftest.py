"""Names available to the docstring examples (run with --doctest-modules)."""

import optree
import pytest
import torch
import torch.nn.functional as F

import packfunc


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace.update(torch=torch, F=F, optree=optree, packfunc=packfunc, pf=packfunc)
