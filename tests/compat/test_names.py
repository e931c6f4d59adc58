"""BackPACK names client libraries import: ``CTX``, ``memory_cleanup``, the convolution
switch, ``custom_module`` and ``alias_backpack``, each against its documented meaning."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from packfunc.compat import alias_backpack, backpack, extend, memory_cleanup
from packfunc.compat.context import CTX
from packfunc.compat.custom_module.branching import Parallel, SumModule
from packfunc.compat.custom_module.graph_utils import BackpackTracer
from packfunc.compat.custom_module.pad import Pad
from packfunc.compat.custom_module.permute import Permute
from packfunc.compat.custom_module.reduce_tuple import ReduceTuple
from packfunc.compat.custom_module.scale_module import ScaleModule
from packfunc.compat.custom_module.slicing import Slicing
from packfunc.compat.extensions import BatchGrad, DiagGGNExact


def test_ctx_reflects_the_innermost_backpack_context():
    def hook(module: nn.Module) -> None:
        return None

    assert CTX.get_active_exts() == () and not CTX.get_debug() and not CTX.get_retain_graph()
    outer, inner = BatchGrad(), DiagGGNExact()
    with backpack(outer):
        with backpack(inner, extension_hook=hook, debug=True, retain_graph=True):
            assert CTX.get_active_exts() == (inner,)
            assert CTX.is_extension_active(DiagGGNExact, BatchGrad)
            assert not CTX.is_extension_active(BatchGrad)
            assert CTX.get_extension_hook() is hook and CTX.get_debug() and CTX.get_retain_graph()
        assert CTX.get_active_exts() == (outer,) and CTX.get_extension_hook()(nn.ReLU()) is None


def test_ctx_removes_the_hooks_it_keeps():
    calls = []
    layer = nn.Linear(2, 2)
    CTX.add_hook_handle(layer.register_forward_hook(lambda *args: calls.append(1)))
    layer(torch.randn(1, 2))
    CTX.remove_hooks()
    layer(torch.randn(1, 2))
    assert calls == [1] and CTX.hook_handles == []


def test_memory_cleanup_forgets_stored_io():
    model = extend(nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1)))
    X = torch.randn(4, 3)
    with backpack(BatchGrad()):
        model(X).sum().backward()
    assert model[0].weight.grad_batch.shape == (4, 2, 3)
    for module in model.modules():
        memory_cleanup(module)
        assert not hasattr(module, "output") and not hasattr(module, "input0")
    memory_cleanup(nn.ReLU())  # nothing stored: nothing to do


def test_custom_modules_compute_what_their_plain_code_does():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4)
    linear = nn.Linear(4, 4)
    parallel = Parallel(nn.Identity(), linear, merge_module=SumModule())
    torch.testing.assert_close(parallel(x), x + linear(x))
    assert [name for name, _ in parallel.named_parameters()] == ["branch.1.weight", "branch.1.bias"]
    torch.testing.assert_close(ScaleModule(2.5)(x), 2.5 * x)
    torch.testing.assert_close(Slicing((slice(None), 1))(x), x[:, 1])
    torch.testing.assert_close(
        Pad((1, 2), mode="constant", value=3.0)(x), nn.functional.pad(x, (1, 2), value=3.0)
    )
    torch.testing.assert_close(Permute(0, 2, 1)(x), x.transpose(1, 2))
    torch.testing.assert_close(Permute(2, 1, init_transpose=True)(x), x.transpose(1, 2))
    output, _ = nn.LSTM(4, 5, batch_first=True)(x)
    assert ReduceTuple(index=0)((output, None)) is output


@pytest.mark.parametrize(
    "make",
    [lambda: ScaleModule(2), lambda: Permute(1, 0), lambda: Permute(0, 2, init_transpose=True)],
)
def test_custom_modules_refuse_what_backpack_refuses(make):
    with pytest.raises(ValueError):
        make()


def test_sum_module_refuses_mismatched_inputs():
    with pytest.raises(AssertionError, match="shape"):
        SumModule()(torch.zeros(2), torch.zeros(3))


def test_backpack_tracer_keeps_custom_modules_whole():
    model = nn.Sequential(nn.Linear(3, 3), ScaleModule(2.0), Permute(0, 1))
    ops = [(node.op, node.target) for node in BackpackTracer().trace(model).nodes]
    assert ops == [
        ("placeholder", "input"),
        ("call_module", "0"),
        ("call_module", "1"),
        ("call_module", "2"),
        ("output", "output"),
    ]


def test_second_order_extensions_through_a_residual_parallel():
    torch.manual_seed(0)
    model = extend(
        nn.Sequential(
            nn.Linear(3, 4),
            Parallel(nn.Identity(), nn.Sequential(nn.Linear(4, 4), nn.Tanh())),
            ScaleModule(0.5),
            nn.Linear(4, 2),
        )
    )
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with backpack(DiagGGNExact()):
        lossfunc(model(X), y).backward()
    params = dict(model.named_parameters())
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
    probs = model(X).softmax(1).detach()
    for name, p in params.items():
        J = jac[name].flatten(2)  # [N, C, P]
        H = (torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]) / len(X)
        expected = torch.einsum("ncp,ncd,ndp->p", J, H, J).view_as(p)
        torch.testing.assert_close(p.diag_ggn_exact, expected, rtol=1e-4, atol=1e-6)


def test_alias_maps_every_path_and_undoes_itself():
    real = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "backpack"}
    with alias_backpack(shadow=True):
        import backpack as aliased
        from backpack.custom_module.slicing import Slicing as AliasedSlicing
        from backpack.extensions import BatchGrad as AliasedBatchGrad

        assert aliased is sys.modules["packfunc.compat"]
        assert AliasedSlicing is Slicing and AliasedBatchGrad is BatchGrad
        with pytest.raises(ModuleNotFoundError):
            import backpack.no_such_module  # noqa: F401
        with alias_backpack():  # nested: the outer one stays
            pass
        assert sys.modules["backpack"] is aliased
    assert {n: m for n, m in sys.modules.items() if n.split(".")[0] == "backpack"} == real


def test_alias_refuses_to_mix_with_an_imported_backpack():
    pytest.importorskip("backpack")
    with pytest.raises(RuntimeError, match="already imported"):
        alias_backpack()
