"""Running a module on given tensors leaves every slot of the module as it was.

``call_with_tensors`` is checked against ``torch.func.functional_call`` where that one is
right, and against the module's own objects where it is not (a submodule at two paths).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

import packfunc as pf
import packfunc.compat as compat
from packfunc.reparametrize import call_with_tensors, named_slots
from tests.cases import HUGGING_FACE, autograd_batch_grad, hugging_face_problem, make_problem


def _slots_of(model: nn.Module) -> dict[str, tuple[dict, str, Tensor, Tensor]]:
    """Every slot with the object it holds and a copy of its values."""
    return {
        name: (store, key, store[key], store[key].detach().clone())
        for name, (store, key) in named_slots(model).items()
    }


def _assert_slots_kept(before: dict[str, tuple[dict, str, Tensor, Tensor]]) -> None:
    for name, (store, key, tensor, values) in before.items():
        assert store[key] is tensor, f"{name} was replaced by another tensor"
        assert torch.equal(tensor, values), f"{name} changed its values"


def test_every_case_keeps_every_parameter_and_buffer(case):
    problem = make_problem(case, n=3)
    before = _slots_of(problem.model)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    pf.compute(model_fn, params, X, y, loss=loss, quantities=pf.FIRST_ORDER)
    pf.diag_ggn(model_fn, params, X, y, loss=loss)
    pf.kfac(model_fn, params, X, y, loss=loss, on_unsupported="skip")
    pf.hessian_vector_product(model_fn, params, X, y, params, loss=loss)
    pf.clipped_grad(model_fn, params, X, y, loss=type(loss)(reduction="sum"), max_norm=1.0)
    _assert_slots_kept(before)


@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_hugging_face_models_keep_every_parameter_and_buffer(name):
    """Their tied embeddings included (GPT-2's head is its token embedding at a second name)."""
    model, X, y = hugging_face_problem(name)
    before = _slots_of(model)
    pf.compute(*pf.functional(model), X, y, quantities=pf.FIRST_ORDER)
    _assert_slots_kept(before)


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.Linear(3, 3)
        self.body = nn.Sequential(layer, nn.Tanh(), layer)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def test_a_submodule_at_two_paths_gets_its_own_parameters_back():
    """torch 2.13's ``functional_call`` leaves the given tensor in it (pytorch#164759)."""
    torch.manual_seed(0)
    model, X = _Shared(), torch.randn(5, 3)
    before = _slots_of(model)
    zeros = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    assert torch.equal(call_with_tensors(model, zeros, (X,), {}), torch.zeros(5, 2))
    _assert_slots_kept(before)
    probe = _Shared()  # the torch bug this guards against, so that the test notices a fix
    functional_call(probe, {"body.0.weight": torch.zeros(3, 3)}, (X,))
    assert not isinstance(probe.body[0].weight, nn.Parameter)


def test_batch_grad_of_a_submodule_at_two_paths_matches_the_loop_and_keeps_the_model():
    torch.manual_seed(0)
    model, X, y = _Shared().double(), torch.randn(5, 3).double(), torch.tensor([0, 1, 1, 0, 1])
    loss = nn.CrossEntropyLoss()
    before = _slots_of(model)
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    _assert_slots_kept(before)
    expected = autograd_batch_grad(model, loss, X, y)
    assert found.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name])


def test_the_shim_keeps_a_submodule_at_two_paths_and_matches_the_loop():
    torch.manual_seed(0)
    model, X, y = _Shared().double(), torch.randn(4, 3).double(), torch.tensor([0, 1, 1, 0])
    expected = autograd_batch_grad(model, nn.CrossEntropyLoss(), X, y)
    model, loss = compat.extend(model), compat.extend(nn.CrossEntropyLoss())
    before = _slots_of(model)
    with compat.backpack(compat.extensions.BatchGrad()):
        loss(model(X), y).backward()
    _assert_slots_kept(before)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad_batch, expected[name])


class _Tied(nn.Module):
    """Two registered names of one parameter, a buffer and a plain tensor attribute."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.register_buffer("shift", torch.ones(3))
        self.scale = torch.tensor(2.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x)) * self.scale + self.shift


@pytest.mark.parametrize(
    "names",
    [
        ("a.weight",),  # its tied name b.weight follows
        ("b.weight", "a.bias"),
        ("a.weight", "b.weight"),  # one tensor given for both
        ("shift",),  # a buffer
        ("scale",),  # a plain attribute: set for the call, as torch does
        (),
    ],
)
def test_values_equal_functional_call(names):
    torch.manual_seed(0)
    model, X = _Tied(), torch.randn(4, 3)
    shared = torch.randn(3, 3)
    given = {name: shared if "weight" in name else torch.randn(()) + 3 for name in names}
    expected = functional_call(model, dict(given), (X,))
    before = _slots_of(model)
    torch.testing.assert_close(call_with_tensors(model, given, (X,), {}), expected, rtol=0, atol=0)
    _assert_slots_kept(before)
    assert torch.equal(model.scale, torch.tensor(2.0))


def test_a_name_the_module_lacks_is_refused():
    """torch sets it as an attribute nothing reads (its quantities would be zero)."""
    model = _Tied()
    with pytest.raises(ValueError, match="'missing', which is no parameter"):
        call_with_tensors(model, {"missing": torch.ones(())}, (torch.randn(2, 3),), {})
    assert not hasattr(model, "missing")


def test_tied_names_given_different_tensors_are_refused():
    model = _Tied()
    given = {"a.weight": torch.zeros(3, 3), "b.weight": torch.ones(3, 3)}
    with pytest.raises(ValueError, match="tied"):
        call_with_tensors(model, given, (torch.randn(2, 3),), {})
    assert isinstance(model.a.weight, nn.Parameter) and model.b.weight is model.a.weight


class _Rebinding(nn.Module):
    """Counts its calls in a buffer it rebinds, and fails when asked to."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor, fail: bool = False) -> Tensor:
        self.calls = self.calls + 1
        if fail:
            raise RuntimeError("asked to fail")
        return self.lin(x)


def test_a_rebound_buffer_is_written_back_to_the_dict_as_torch_does():
    model = _Rebinding()
    own = model.calls
    mine, theirs = {"calls": torch.zeros(())}, {"calls": torch.zeros(())}
    call_with_tensors(model, mine, (torch.ones(1, 2),), {})
    functional_call(model, theirs, (torch.ones(1, 2),))
    assert torch.equal(mine["calls"], theirs["calls"]) and mine["calls"].item() == 1
    assert model.calls is own and own.item() == 0


def test_a_forward_that_raises_leaves_the_given_slots_as_they_were():
    model = _Rebinding()
    before = _slots_of(model.lin)  # (its buffer it rebinds itself)
    with pytest.raises(RuntimeError, match="asked to fail"):
        call_with_tensors(
            model, {"lin.weight": torch.zeros(2, 2)}, (torch.ones(1, 2),), {"fail": True}
        )
    _assert_slots_kept(before)


@pytest.mark.parametrize("wrap", ["weight_norm", "spectral_norm"])
@pytest.mark.filterwarnings("ignore:.*is deprecated")
def test_the_old_reparametrizations_keep_a_plain_weight_of_the_users_forward(wrap):
    """The old ``weight_norm``/``spectral_norm`` set ``module.weight`` in a pre-hook: after a
    call, it held the weight of packfunc's pass on its tapped parameters (a tensor of
    packfunc's type, off the graph); it keeps the user's last forward's, and the
    per-sample gradients are those of a loop."""
    torch.manual_seed(0)
    layer = getattr(nn.utils, wrap)(nn.Linear(4, 4).double())
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 3).double()).eval()
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    model(X)
    users = layer.weight
    model_fn, params = pf.functional(model)
    loss = nn.CrossEntropyLoss(reduction="sum")
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    assert layer.weight is users and type(layer.weight) is Tensor and users.requires_grad
    expected = autograd_batch_grad(model, loss, X, y)
    for name in expected:
        torch.testing.assert_close(found[name], expected[name])


def _counting_model() -> torch.nn.Module:
    """A model with a buffer its forward updates (a step counter, as a scheduler keeps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def count(module: torch.nn.Module, args: tuple) -> None:
        with torch.no_grad():
            module.calls += 1

    model.register_forward_pre_hook(count)
    return model


def test_a_function_around_the_model_counts_as_running_it():
    """``lambda p, X: model_fn(p, X).logits`` (README's Hugging Face pattern) or a function
    closing over the module hid the module: discovery's forward of one sample updated its
    buffers too (a counter went up twice per call), and its buffers were not known for
    constants (BERT's position ids sent its position embeddings to the whole-model path)."""
    model = _counting_model()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])

    def around(p, X):
        return model_fn(p, X) * 1.0

    def closing_over(p, X):
        return torch.func.functional_call(model, p, (X,))

    for function in (around, closing_over):
        before = int(model.calls)
        pf.batch_grad(function, params, X, y)
        assert int(model.calls) == before + 1


def test_a_parametrization_registered_after_functional_names_the_fix():
    """params under the plain name of a weight parametrized since: torch set it through
    ``right_inverse`` and wrote another tensor into the user's dict (packfunc then raised a
    bare ``KeyError`` of a tensor id, or blamed a buffer); refused, the dict untouched."""
    from torch.nn.utils import parametrize

    class Affine(nn.Module):
        def forward(self, weight: Tensor) -> Tensor:
            return weight * 2 + 0.1

        def right_inverse(self, weight: Tensor) -> Tensor:
            return (weight - 0.1) / 2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    pf.batch_grad(model_fn, params, X, y)
    parametrize.register_parametrization(model[0], "weight", Affine())
    given = params["0.weight"]
    with pytest.raises(ValueError, match="'0.weight', a parametrized weight.*pf.functional"):
        pf.batch_grad(model_fn, params, X, y)
    assert params["0.weight"] is given


def test_a_function_closing_over_several_modules_counts_as_running_them_all():
    """A model and a frozen teacher (or the model in a dict): ``module_of`` found none, so
    discovery's forward of one sample stayed on the model's buffers and attributes (a
    counter went up three times per call; a refused call left spectral norm's ``u``
    advanced)."""
    model, teacher = _counting_model(), torch.nn.Linear(3, 2)
    model.steps = 0
    model.register_forward_pre_hook(lambda module, args: setattr(module, "steps", module.steps + 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    X, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    holder = {"net": model}

    def distilled(p, X):
        return torch.func.functional_call(model, p, (X,)) - teacher(X).detach()

    def in_a_dict(p, X):
        return torch.func.functional_call(holder["net"], p, (X,))

    for function in (distilled, in_a_dict):
        calls, steps = int(model.calls), model.steps
        pf.batch_grad(function, params, X, y)
        assert (int(model.calls), model.steps) == (calls + 1, steps + 1)
        pf.explain(function, params, X)
        assert (int(model.calls), model.steps) == (calls + 1, steps + 1)

    torch.manual_seed(1)
    normed = torch.nn.Sequential(torch.nn.utils.spectral_norm(torch.nn.Linear(3, 2))).train()
    params = {k: v.detach() for k, v in normed.named_parameters()}
    u = normed[0].weight_u.clone()

    def with_teacher(p, X):
        return torch.func.functional_call(normed, p, (X,)) - teacher(X).detach()

    with pytest.raises(ValueError, match="normed.0.weight_u"):
        pf.batch_grad(with_teacher, params, X, y)
    assert torch.equal(normed[0].weight_u, u)


def test_containers_a_forward_changes_in_place_keep_only_the_users_forward():
    """A list or dict attribute the forward appends to (a log, a counter in a dict) kept
    what packfunc's own runs added (``[1, 4, 1]`` where the user's forward leaves ``[4]``);
    and attributes the forward rotates (deleted and set again) passed the restorer's check
    of unchanged values by position."""

    class Logging(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)
            self.seen: list[int] = []
            self.stats = {"calls": 0}
            self.a, self.b, self.c = "X", "Y", "Z"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(x.shape[0])
            self.stats["calls"] += 1
            a, b, c = self.a, self.b, self.c
            del self.a, self.b, self.c
            self.b, self.c, self.a = c, a, b  # keys reordered, values rotated
            return self.layer(x)

    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    model = Logging()
    model_fn, params = pf.functional(model)
    pf.batch_grad(model_fn, params, X, y)
    assert (model.seen, model.stats) == ([4], {"calls": 1})
    assert (model.a, model.b, model.c) == ("Y", "Z", "X")  # one forward of the user's
    pf.explain(model_fn, params, X)
    assert (model.seen, model.stats) == ([4], {"calls": 1})
    assert (model.a, model.b, model.c) == ("Y", "Z", "X")


def test_containers_of_other_kinds_and_nested_ones_keep_only_the_users_forward():
    """Found by a probe: an ``OrderedDict``, a ``deque``, a ``defaultdict`` and a list held in
    a dict kept packfunc's own runs' entries (``[1, 4, 1]``, with ``diag_hessian``
    ``[1, 4, 1, 4, 4]``); only exact lists, dicts and sets at the top were put back."""
    import collections

    class Logging(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)
            self.ordered: collections.OrderedDict[int, int] = collections.OrderedDict()
            self.recent: collections.deque[int] = collections.deque(maxlen=100)
            self.counts: collections.defaultdict[int, int] = collections.defaultdict(int)
            self.nested: dict[str, list[int]] = {"sizes": []}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            self.ordered[len(self.ordered)] = n
            self.recent.append(n)
            self.counts[len(self.counts)] += n
            self.nested["sizes"].append(n)
            return self.layer(x)

    def state(model: Logging) -> tuple:
        return (
            list(model.ordered.values()),
            list(model.recent),
            list(model.counts.values()),
            model.nested["sizes"],
        )

    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    for quantity in (pf.batch_grad, pf.diag_hessian):
        model = Logging()
        model_fn, params = pf.functional(model)
        quantity(model_fn, params, X, y)
        assert state(model) == ([4], [4], [4], [4])


class _Counting(torch.nn.Module):
    """Logs each forward's batch size and counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.log: list[int] = []
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(x.shape[0])
        self.calls += 1
        return torch.tanh(self.layer(x))


_OWN_PASSES = {
    "diag_hessian": lambda fn, p, X, y: pf.diag_hessian(fn, p, X, y),
    "batch_diag_hessian": lambda fn, p, X, y: pf.batch_diag_hessian(fn, p, X, y),
    "hessian_vector_product": lambda fn, p, X, y: pf.hessian_vector_product(
        fn, p, X, y, {k: torch.ones_like(t) for k, t in p.items()}
    ),
}


@pytest.mark.parametrize("quantity", list(_OWN_PASSES))
def test_closed_over_modules_keep_what_a_pf_functional_model_keeps(quantity):
    """Found by a probe: a hand-written model function (``functional_call`` on a closed-over
    model, a closed-over teacher) left packfunc's own extra passes on its modules (a
    ``diag_hessian`` logged ``[4, 4]``, 2 calls; ``pf.functional``'s model: ``[4]``, 1). Its
    modules are put back after each of packfunc's own passes as ``pf.functional``'s are."""
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    found = []
    for how in ("pf.functional", "closure", "teacher"):
        torch.manual_seed(0)
        model, teacher = _Counting(), _Counting()
        model_fn, params = _model_function(how, model, teacher)
        _OWN_PASSES[quantity](model_fn, params, X, y)
        found.append((model.log, model.calls))
        if how == "teacher":
            assert (teacher.log, teacher.calls) == (model.log, model.calls)
    assert found[1] == found[0] and found[2] == found[0]
    assert found[0] in (([4], 1), ([], 0))


def _model_function(how: str, model: nn.Module, teacher: nn.Module):
    """``pf.functional``'s model function, one closing over ``model``, or one over a teacher."""
    if how == "pf.functional":
        return pf.functional(model)
    params = {k: t.detach() for k, t in model.named_parameters()}
    if how == "closure":
        return lambda p, x: functional_call(model, p, (x,)), params
    student = pf.functional(model)[0]
    return lambda p, x: student(p, x) - 0.5 * teacher(x).detach(), params


def test_modules_reached_through_partials_defaults_and_wrappers_are_kept():
    """A module passed by ``functools.partial``, as a default argument, or through a
    wrapper of a wrapper was not found: discovery's forward stayed on its buffers."""
    import functools

    def base(model, p, X):
        return torch.func.functional_call(model, p, (X,))

    def wrapped(model):
        inner = lambda p, X: base(model, p, X)  # noqa: E731
        return lambda p, X: inner(p, X) * 1.0

    def with_default(model):
        def run(p, X, model=model):
            return base(model, p, X)

        return run

    X, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    for make in (lambda m: functools.partial(base, m), wrapped, with_default):
        model = _counting_model()
        params = {k: v.detach() for k, v in model.named_parameters()}
        pf.batch_grad(make(model), params, X, y)
        assert int(model.calls) == 1


def test_tensors_and_hooks_a_forward_changes_are_those_of_the_users_forward_alone():
    """An average kept in a dict of tensors, updated in place, was updated by packfunc's
    own forwards too (discovery, the check of rows, ``pf.explain``); a hook the forward
    registers once was registered again after discovery put its flag back."""

    class Averaging(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)
            self.stats = {"mean": torch.zeros(3)}
            self._hooked = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.stats["mean"].mul_(0.9).add_(0.1 * x.mean(0))
            if not self._hooked:
                self.layer.register_forward_hook(lambda module, args, out: None)
                self._hooked = True
            return self.layer(x)

    torch.manual_seed(0)
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    users = Averaging()
    users(X)
    model = Averaging()
    model_fn, params = pf.functional(model)
    pf.explain(model_fn, params, X)
    assert torch.equal(model.stats["mean"], torch.zeros(3))
    assert (len(model.layer._forward_hooks), model._hooked) == (0, False)
    pf.batch_grad(model_fn, params, X, y)
    torch.testing.assert_close(model.stats["mean"], users.stats["mean"], rtol=0, atol=0)
    assert len(model.layer._forward_hooks) == 1


class _RecurrentHead(nn.Module):
    """An LSTM and a linear head on its last step."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(3, 3, batch_first=True), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def test_a_recurrent_layer_holds_its_own_weights_after_a_call():
    """``nn.LSTM._flat_weights`` kept the tensors of packfunc's call (its forward fills
    it): the model's ``__dict__`` changed and held the caller's params alive (a probe)."""
    torch.manual_seed(0)
    model = _RecurrentHead()
    fn, p = pf.functional(model)
    other = {k: torch.randn_like(v) for k, v in p.items()}
    X, y = torch.randn(3, 4, 3), torch.tensor([0, 1, 1])
    pf.batch_grad(fn, other, X, y)
    fn(other, X)
    assert all(
        w is getattr(model.rnn, n)
        for w, n in zip(model.rnn._flat_weights, model.rnn._flat_weights_names)
    )
    assert all(r() is w for r, w in zip(model.rnn._flat_weight_refs, model.rnn._flat_weights))
