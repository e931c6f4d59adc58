"""The user's model as packfunc found it: buffers and attributes put back after packfunc's passes.

A quantity runs the model more than once: discovery on one sample, a check on the last
sample, the whole-model path, second derivatives, the shim's own pass. Only one of them is a
forward pass of the user's (the batch pass of a :func:`packfunc.functional` model; in the
shim, the user's own forward): whatever the others set on the model (a running statistic, a
call counter, a forward hook keeping the last activation, the old ``weight_norm``'s weight)
is put back. Within a public call (:func:`packfunc_passes`), every call of a
:func:`packfunc.functional` model function but the batch pass (:func:`users_forward`) puts
back the attributes it set (:func:`restoring_attributes`).
"""

from __future__ import annotations

import collections
import contextlib
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, cast

import torch
from torch import Tensor, nn

__all__ = [
    "attribute_restorer",
    "buffer_restorer",
    "held_entries",
    "held_modules",
    "is_packfunc_tensor",
    "made_in_a_pass",
    "kept_model_state",
    "modules_with_held",
    "packfunc_passes",
    "restart_users_forward",
    "restoring_attributes",
    "users_forward",
]


@contextlib.contextmanager
def kept_model_state(module: nn.Module | None) -> Iterator[list[str]]:
    """Put ``module``'s buffers and attributes back as they were: this forward is not the user's.

    A forward that updates a buffer (a running mean, spectral norm's power iteration) would
    otherwise update it once more, with one sample, before the batch's own forward; one
    that sets attributes would keep those of packfunc's pass.

    Args:
        module: The module of a :func:`packfunc.functional` model, or ``None`` (nothing kept).

    Yields:
        A list that names, once the block is left, the buffers it changed.

    Example:
        >>> norm = torch.nn.BatchNorm1d(2)
        >>> with kept_model_state(norm) as changed:
        ...     _ = norm(torch.randn(4, 2))
        >>> norm.running_mean, changed
        (tensor([0., 0.]), ['running_mean', 'running_var', 'num_batches_tracked'])
    """
    restore_buffers = buffer_restorer(module)
    restore_attributes = attribute_restorer(module, whole=True)
    changed: list[str] = []
    try:
        yield changed
    finally:
        changed += restore_buffers()
        restore_attributes()


def buffer_restorer(module: nn.Module | None) -> Callable[[], list[str]]:
    """A function that puts ``module``'s buffers back as they are now, values and versions.

    Args:
        module: A module, or ``None`` (nothing kept).

    Returns:
        ``restore()``, which returns the names of the buffers it put back.

    Example:
        >>> norm = torch.nn.BatchNorm1d(2)
        >>> restore = buffer_restorer(norm)
        >>> _ = norm(torch.randn(4, 2))
        >>> restore(), norm.running_mean
        (['running_mean', 'running_var', 'num_batches_tracked'], tensor([0., 0.]))
    """
    named = [
        (owner, f"{prefix}.{name}" if prefix else name, name, buffer, buffer.clone())
        for prefix, owner in modules_with_held(module)
        for name, buffer in owner.named_buffers(recurse=False)
        if buffer.device.type != "meta"
    ]
    versions = [buffer._version for *_, buffer, _ in named]

    def restore() -> list[str]:
        changed = []
        with torch.no_grad():
            for (owner, qualified, name, buffer, value), version in zip(named, versions):
                if owner._buffers.get(name) is not buffer:  # rebound
                    owner._buffers[name] = buffer
                    changed.append(qualified)
                elif not torch.equal(buffer, value):
                    buffer.copy_(value)
                    # its version too: to autograd (a graph that saved it) and to the shim's
                    # check for a model changed since its forward, it never changed
                    torch._C._autograd._unsafe_set_version_counter((buffer,), (version,))
                    changed.append(qualified)
        return changed

    return restore


_MISSING = object()
"""Stands in for an attribute a module does not have (see :func:`attribute_restorer`)."""


class Restore(Protocol):
    """``restore()`` puts every attribute back; ``restore(only)``, those ``only(was, is)`` picks."""

    def __call__(self, only: Callable[[object, object], bool] = ...) -> None: ...


def attribute_restorer(module: nn.Module | None, whole: bool = False) -> Restore:
    """A function that puts the attributes of ``module`` and its submodules back as they are now.

    An attribute set since is put back, one added is deleted, a list, dict or set changed
    in place gets its entries back (each module's own ``__dict__``; the dicts of
    parameters, buffers and children are kept as they are: buffers have
    :func:`buffer_restorer`). ``restore(only)`` does that for the attributes
    ``only(value_before, value_now)`` picks (a missing value is ``_MISSING``). ``whole``
    (a forward that is not the user's at all) also removes hooks registered since and puts
    back the values of tensors held in attributes that were changed in place (an
    exponential average kept in a dict).

    Args:
        module: A module, or ``None`` (nothing kept).
        whole: Whether to keep hooks and tensors' values too (each tensor is copied).

    Returns:
        ``restore()``.

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> restore = attribute_restorer(layer)
        >>> layer.calls = 1
        >>> restore(); hasattr(layer, "calls")
        False
    """
    owners = submodules(module)
    saved = []
    known = {id(owner) for owner in owners}
    for owner in owners:  # (grows: modules held in plain attributes are owners too)
        contents, modules = _contents(owner.__dict__, hooks=whole)
        saved.append((owner.__dict__, owner.__dict__.copy(), tuple(owner.__dict__), contents))
        for held in modules:
            for found in submodules(held):
                if id(found) not in known:
                    known.add(id(found))
                    owners.append(found)
    tensors = [kept for owner in owners for kept in _held_tensors(owner.__dict__)] if whole else []

    def restore(only: Callable[[object, object], bool] = lambda before, now: True) -> None:
        with torch.no_grad():
            for tensor, version, value in tensors:
                if tensor._version != version:
                    tensor.copy_(value)
        for now, before, keys, contents in saved:
            for container, copy in contents:
                if not _same_contents(container, copy) and only(copy, container):
                    _refill(container, copy)
            unchanged = all(map(operator.is_, now.values(), before.values()))
            if tuple(now) == keys and unchanged:
                continue
            for key in [key for key in now if key not in before and only(_MISSING, now[key])]:
                del now[key]
            now.update(
                (key, value)
                for key, value in before.items()
                if now.get(key, _MISSING) is not value and only(value, now.get(key, _MISSING))
            )

    return restore


Container = list[object] | dict[object, object] | set[object] | collections.deque[object]
_CONTAINERS = (list, dict, set, collections.deque)
_NESTED_LIMIT = 64
"""The most entries of a container whose own containers are kept too."""


def _contents(
    attributes: dict[str, object], hooks: bool
) -> tuple[list[tuple[Container, Container]], list[nn.Module]]:
    """A module's own lists, dicts, sets and deques with copies, and the modules it holds.

    The modules its attributes hold outside its registered children: :func:`held_modules`.
    Containers of subclasses too (an ``OrderedDict``, a ``defaultdict``), and those held
    one level in (a list of sizes in a dict of logs, in containers of up to 64 entries). A
    forward may append to them: what packfunc's own runs add is taken out again. With
    ``hooks``, so are the hooks registered since in the module's dicts of hooks (a forward
    that registers one once; a copy of such a dict holds only its keys, see :func:`_refill`).
    One pass over the attributes finds both.
    """
    containers: list[Container] = []
    modules: list[nn.Module] = []
    for key in attributes.keys() - MODULE_INTERNALS:
        value = attributes[key]
        if isinstance(value, _CONTAINERS):
            containers.append(cast(Container, value))
        if isinstance(value, _HOLDERS):
            modules += held_modules(value)
    return _copied(containers, attributes, hooks), modules


_HOLDERS = (nn.Module, list, tuple, dict)


def _copied(
    containers: list[Container], attributes: dict[str, object], hooks: bool
) -> list[tuple[Container, Container]]:
    """The containers and those one level in, with copies (and the hooks' dicts, with ``hooks``)."""
    for outer in list(containers):  # one level in: a list of sizes in a dict of logs
        if len(outer) <= _NESTED_LIMIT:
            entries = outer.values() if isinstance(outer, dict) else outer
            containers += [cast(Container, e) for e in entries if isinstance(e, _CONTAINERS)]
    found: list[tuple[Container, Container]] = [(value, value.copy()) for value in containers]
    if hooks:
        found += [
            (value, set(value))
            for key, value in attributes.items()
            if key in MODULE_INTERNALS and "hooks" in key and isinstance(value, dict)
        ]
    return found


HELD_ENTRIES = 64
"""The most entries of a list, tuple or dict whose modules count as held."""


def held_modules(value: object) -> list[nn.Module]:
    """The modules an attribute holds outside the registered tree (no ``nn.ModuleList``).

    The value itself (set past ``nn.Module.__setattr__``), or the modules in a list, tuple or
    dict (subclasses too) of up to 64 entries, and one level further in (``[[layer]]``). A
    forward that calls ``self.acts[0](x)`` runs such a module as a child: packfunc keys its
    plans on it and puts back what it sets as a child's.

    Args:
        value: An attribute's value.

    Returns:
        The modules, in order (possibly repeated).

    Example:
        >>> len(held_modules([torch.nn.ReLU(), 2, (torch.nn.Tanh(),)])), held_modules(3)
        (2, [])
    """
    if isinstance(value, nn.Module):
        return [value]
    found: list[nn.Module] = []
    for entry in held_entries(value):
        if isinstance(entry, nn.Module):
            found.append(entry)
        else:
            found += [inner for inner in held_entries(entry) if isinstance(inner, nn.Module)]
    return found


def held_entries(value: object) -> list[object]:
    """The entries of a list, tuple or dict (its values) of up to 64 entries, else none.

    Example:
        >>> held_entries({"a": 1}), held_entries("ab"), held_entries(list(range(65)))
        ([1], [], [])
    """
    if isinstance(value, (list, tuple)) and len(value) <= HELD_ENTRIES:
        return list(value)
    if isinstance(value, dict) and len(value) <= HELD_ENTRIES:
        return list(value.values())
    return []


def modules_with_held(module: nn.Module | None) -> list[tuple[str, nn.Module]]:
    """``module.named_modules()`` and the modules held in plain attributes, each once.

    A held module is named by its holder's attribute (``acts.held``). Not for every call's
    hot path: each module's attributes are read (see :func:`held_modules`).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(1, 1))
        >>> net.acts = [torch.nn.ReLU()]
        >>> [name for name, _ in modules_with_held(net)]
        ['', '0', 'acts.held']
    """
    if module is None:
        return []
    found: dict[int, tuple[str, nn.Module]] = {}
    stack = [("", module)]
    while stack:
        prefix, current = stack.pop()
        if id(current) in found:
            continue
        found[id(current)] = (prefix, current)
        children = [
            (f"{prefix}.{name}" if prefix else name, child)
            for name, child in current._modules.items()
            if child is not None
        ]
        for key, value in current.__dict__.items():
            if key not in MODULE_INTERNALS and isinstance(value, _HOLDERS):
                name = f"{prefix}.{key}.held" if prefix else f"{key}.held"
                children += [(name, held) for held in held_modules(value)]
        stack.extend(reversed(children))
    return list(found.values())


def _held_tensors(attributes: dict[str, object]) -> list[tuple[Tensor, int, Tensor]]:
    """The tensors a module holds in plain attributes, lists and dicts, with copies.

    Each with its version (a change in place moves it) and a copy of its value.
    """
    found: dict[int, Tensor] = {}
    for key, value in attributes.items():
        if key in MODULE_INTERNALS:
            continue
        entries: list[object] = (
            list(value.values())
            if isinstance(value, dict)
            else list(value)
            if isinstance(value, (list, tuple))
            else [value]
        )
        for entry in entries:
            if _plain_tensor(entry):
                found[id(entry)] = cast(Tensor, entry)
    return [(t, t._version, t.detach().clone()) for t in found.values()]


def _plain_tensor(value: object) -> bool:
    """A dense tensor outside autograd's graph (an average, a cache), whose value is kept."""
    return (
        isinstance(value, Tensor)
        and not value.requires_grad
        and value.layout == torch.strided
        and value.device.type != "meta"
        and not value.is_inference()  # (no version to tell a change by)
    )


def _same_contents(container: Container, copy: Container) -> bool:
    """Whether a container still holds the same objects as its copy (compared by identity)."""
    if isinstance(container, dict) and isinstance(copy, set):  # hooks: none added
        return container.keys() <= copy
    if len(container) != len(copy):
        return False
    if isinstance(container, dict):
        assert isinstance(copy, dict)
        same_values = all(map(operator.is_, container.values(), copy.values()))
        return tuple(container) == tuple(copy) and same_values
    if isinstance(container, (list, collections.deque)):
        return all(map(operator.is_, container, copy))
    return container == copy


def _refill(container: Container, copy: Container) -> None:
    """Put a container's contents back in place (the module holds that very container).

    A dict of hooks copied as the set of its keys loses the hooks registered since (and
    keeps those removed since: packfunc's own hooks may be).
    """
    if isinstance(container, dict) and isinstance(copy, set):
        for key in [key for key in container if key not in copy]:
            del container[key]
        return
    container.clear()
    if isinstance(container, (list, collections.deque)):
        container.extend(copy)
    else:
        container.update(copy)  # type: ignore[arg-type]


MODULE_INTERNALS = frozenset(
    key for key, value in torch.nn.Module().__dict__.items() if isinstance(value, (dict, set))
)
"""The dicts and sets every ``nn.Module`` holds (its parameters, buffers, children, hooks)."""


def is_packfunc_tensor(value: object) -> bool:
    """Whether ``value`` is a tensor of one of packfunc's own types (a tapped parameter's).

    A forward of the user's that packfunc runs on its tapped parameters leaves such a
    tensor in an attribute it sets (the old ``weight_norm``'s ``weight``): not what the
    user's own forward would leave, a plain tensor on their parameters' graph.

    Example:
        >>> is_packfunc_tensor(torch.ones(1)), is_packfunc_tensor("weight")
        (False, False)
    """
    return isinstance(value, torch.Tensor) and type(value).__module__.startswith("packfunc.")


def made_in_a_pass(before: object, now: object) -> bool:
    """Whether an attribute a pass of packfunc's set holds what the pass made of its leaves.

    A tensor of packfunc's own types (:func:`is_packfunc_tensor`), or a tensor in place of
    one on the user's parameters' graph (the old ``weight_norm``'s ``weight``, which their
    own forward leaves requiring grad; packfunc's pass leaves one on its own leaves). Other
    values the forward sets (a counter, a detached activation) stay, as after the user's
    forward.

    Args:
        before: The attribute's value before the pass (``_MISSING`` if it had none).
        now: Its value after it.

    Returns:
        Whether to put the attribute back.

    Example:
        >>> users = torch.ones(1, requires_grad=True) * 2
        >>> made_in_a_pass(users, torch.ones(1)), made_in_a_pass(torch.ones(1), torch.ones(1))
        (True, False)
    """
    if is_packfunc_tensor(now):
        return True
    on_users_graph = isinstance(before, torch.Tensor) and before.requires_grad
    return on_users_graph and isinstance(now, torch.Tensor)


def submodules(module: nn.Module | None) -> list[nn.Module]:
    """``module`` and every module below it, each once (``module.modules()``, 4× faster).

    Restorers and the check for compiled submodules walk the model before every batch pass:
    their cost is paid on every call. The order carries no structure (the plan's key walks
    the tree itself, :func:`~packfunc.engine.discovery._tree_settings`).

    Args:
        module: A module, or ``None`` (none).

    Returns:
        The modules, each once, in an order the tree fixes.

    Example:
        >>> len(submodules(torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU())))
        3
    """
    if module is None:
        return []
    found = {id(module): module}
    stack = [module]
    while stack:
        for child in stack.pop()._modules.values():
            if child is not None and (key := id(child)) not in found:
                found[key] = child
                stack.append(child)
    return list(found.values())


_THREAD = threading.local()
"""Per thread: how deep in packfunc's calls (``depth``) and in a user's forward (``forward``)."""


@contextlib.contextmanager
def packfunc_passes() -> Iterator[None]:
    """Mark the calling thread's model calls as packfunc's (a public call, the shim's work).

    Example:
        >>> with packfunc_passes():
        ...     restoring_attributes()
        True
    """
    _THREAD.depth = getattr(_THREAD, "depth", 0) + 1
    try:
        yield
    finally:
        _THREAD.depth -= 1


@contextlib.contextmanager
def users_forward(put_back: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Mark the calling thread's model calls as the user's forward (the batch pass) for a while.

    What they set on the model stays, as after a forward of the user's own, unless the
    forward starts again (:func:`restart_users_forward`).

    Args:
        put_back: An :func:`attribute_restorer` taken before the forward (by default the
            forward does not start again).

    Example:
        >>> with packfunc_passes(), users_forward():
        ...     restoring_attributes()
        False
    """
    outer = getattr(_THREAD, "forward", None)
    _THREAD.forward = put_back
    try:
        yield
    finally:
        _THREAD.forward = outer


def restart_users_forward() -> None:
    """Put back what the user's forward set so far: it stopped and runs again from the start.

    Example:
        >>> restart_users_forward()  # outside a forward: nothing to put back
    """
    put_back = getattr(_THREAD, "forward", None)
    if put_back is not None:
        put_back()


def restoring_attributes() -> bool:
    """Whether a model call now is one of packfunc's own: its attributes are put back.

    Returns:
        ``True`` inside :func:`packfunc_passes` and not inside :func:`users_forward`.

    Example:
        >>> restoring_attributes()  # the user's own call
        False
    """
    return getattr(_THREAD, "depth", 0) > 0 and getattr(_THREAD, "forward", None) is None
