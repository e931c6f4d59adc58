"""Run BackPACK's documentation examples, unchanged but for their import prefix.

The examples are not copied into this repository: they are read at test time
from BackPACK's source distribution (``backpack_for_pytorch-1.7.1.tar.gz``),
which ``.ci/run`` downloads into ``.cache/backpack-sdist/`` (or point the
environment variable ``PACKFUNC_BACKPACK_SDIST`` at the tarball or at its
extracted folder). If neither is there, :func:`locate_sdist` downloads it with
``pip download``.

Each example's source goes through three kinds of text substitutions, all of
them here and each checked to apply:

* the import prefix ``backpack`` becomes the package under test (for
  ``packfunc.compat``; real BackPACK keeps it, to prove the harness itself);
* per example, a few constants that set how long an example trains or
  samples (``MAX_ITER``, numbers of Monte-Carlo vectors ...) are shrunk;
* nothing else: the data the examples download (MNIST through
  ``backpack.utils.examples``) comes from a stand-in module injected as
  ``<package>.utils.examples`` (:func:`make_examples_module`): scikit-learn's
  bundled digits, upsampled to MNIST's ``[1, 28, 28]``, and an autograd GGN
  diagonal that shares no code with either package.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tarfile
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.functional import interpolate, pad
from torch.utils.data import DataLoader, TensorDataset

BACKPACK_VERSION = "1.7.1"
SDIST_NAME = f"backpack_for_pytorch-{BACKPACK_VERSION}.tar.gz"
SDIST_ENV = "PACKFUNC_BACKPACK_SDIST"
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache" / "backpack-sdist"
EXAMPLES_DIR = f"backpack_for_pytorch-{BACKPACK_VERSION}/docs_src/examples"

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the normalization BackPACK's loader applies


@dataclass(frozen=True)
class Example:
    """One documentation example and how to run it quickly.

    Attributes:
        name: Test id.
        path: Source file, relative to ``docs_src/examples``.
        substitutions: ``(pattern, replacement)`` regular expressions (multiline) applied
            to the source before it runs; each must match at least once.
        requires: Modules the example imports besides torch and the package under test.
        prints_checks: Whether some of its checks only print their outcome (``... match?
            False``) instead of raising.
    """

    name: str
    path: str
    substitutions: tuple[tuple[str, str], ...] = ()
    requires: tuple[str, ...] = ()
    prints_checks: bool = False


# ---------------------------------------------------------------------------
# Locating and reading the sdist
# ---------------------------------------------------------------------------


class SdistUnavailable(RuntimeError):
    """BackPACK's sdist is neither given, cached nor downloadable."""


def locate_sdist() -> Path:
    """Path of BackPACK's sdist (tarball or extracted folder), downloading it if needed.

    Raises:
        SdistUnavailable: If ``PACKFUNC_BACKPACK_SDIST`` names a missing path, or the
            download fails.
    """
    given = os.environ.get(SDIST_ENV)
    if given:
        path = Path(given)
        if not path.exists():
            raise SdistUnavailable(f"{SDIST_ENV}={given} does not exist")
        return path
    cached = CACHE_DIR / SDIST_NAME
    if cached.exists():
        return cached
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"backpack-for-pytorch=={BACKPACK_VERSION}",
        "-d",
        str(CACHE_DIR),
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=300)
    except (subprocess.SubprocessError, OSError) as error:
        raise SdistUnavailable(f"`{' '.join(command)}` failed: {error}") from error
    if not cached.exists():
        raise SdistUnavailable(f"pip download did not produce {cached}")
    return cached


@functools.cache
def read_example(sdist: Path, path: str) -> str:
    """Source of ``docs_src/examples/<path>`` in the sdist (tarball or extracted folder)."""
    if sdist.is_dir():
        folder = sdist / "docs_src" / "examples"
        if not folder.exists():  # the folder that holds the extracted sdist
            folder = sdist / EXAMPLES_DIR
        return (folder / path).read_text()
    with tarfile.open(sdist) as archive:
        member = archive.extractfile(f"{EXAMPLES_DIR}/{path}")
        if member is None:
            raise FileNotFoundError(f"{path} is not a file in {sdist}")
        return member.read().decode()


# ---------------------------------------------------------------------------
# Source rewriting
# ---------------------------------------------------------------------------

_FROM_BACKPACK = re.compile(r"^(\s*)from backpack(?=[.\s])", re.MULTILINE)
_IMPORT_BACKPACK = re.compile(r"^\s*import backpack\b", re.MULTILINE)


def rewrite_imports(source: str, package: str) -> str:
    """Replace the import prefix ``backpack`` by ``package`` in ``from backpack... import``.

    Raises:
        ValueError: If the source has a plain ``import backpack...`` statement (no
            example has one; its rewrite would bind another name).
    """
    if _IMPORT_BACKPACK.search(source):
        raise ValueError("plain `import backpack` statements are not rewritten")
    return _FROM_BACKPACK.sub(rf"\1from {package}", source)


def apply_substitutions(source: str, substitutions: Iterable[tuple[str, str]]) -> str:
    """Apply each ``(pattern, replacement)``; every pattern must match.

    Raises:
        ValueError: If a pattern no longer matches (the example changed upstream).
    """
    for pattern, replacement in substitutions:
        source, count = re.subn(pattern, replacement, source, flags=re.MULTILINE)
        if count == 0:
            raise ValueError(f"substitution {pattern!r} matches nothing")
    return source


def prepare_source(sdist: Path, example: Example, package: str) -> str:
    """The example's source, shrunk and importing from ``package``."""
    source = read_example(sdist, example.path)
    return rewrite_imports(apply_substitutions(source, example.substitutions), package)


# ---------------------------------------------------------------------------
# Stand-in for ``backpack.utils.examples`` (which downloads MNIST via torchvision)
# ---------------------------------------------------------------------------


@functools.cache
def _digits_as_mnist() -> tuple[Tensor, Tensor]:
    """scikit-learn's 1797 bundled 8x8 digits as normalized ``[N, 1, 28, 28]`` images."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.as_tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    x = interpolate(x, scale_factor=3, mode="bilinear", align_corners=False)  # 24 x 24
    x = pad(x, (2, 2, 2, 2))  # MNIST's digits also sit inside an empty border: 28 x 28
    x = (x - MNIST_MEAN) / MNIST_STD
    return x, torch.as_tensor(labels, dtype=torch.long)


def load_mnist_dataset() -> TensorDataset:
    """Digits standing in for the normalized MNIST training set."""
    return TensorDataset(*_digits_as_mnist())


def get_mnist_dataloader(batch_size: int = 64, shuffle: bool = True) -> DataLoader:
    """Loader over the stand-in dataset (shuffled with torch's global generator)."""
    return DataLoader(load_mnist_dataset(), batch_size=batch_size, shuffle=shuffle)


def load_one_batch_mnist(
    batch_size: int = 64, shuffle: bool = True, flat: bool = False
) -> tuple[Tensor, Tensor]:
    """One mini-batch ``(inputs, labels)``; ``flat`` gives inputs ``[batch_size, 784]``."""
    X, y = next(iter(get_mnist_dataloader(batch_size, shuffle)))
    return (X.flatten(start_dim=1) if flat else X), y


def autograd_diag_ggn_exact(
    X: Tensor,
    y: Tensor,
    model: nn.Module,
    loss_function: nn.Module,
    idx: Iterable[int] | Tensor | None = None,
) -> Tensor:
    """Entries ``idx`` of the GGN diagonal (flattened parameters), with plain autograd.

    Entry ``d`` is ``(J e_d)ᵀ H (J e_d)``: ``J`` the Jacobian of the model output w.r.t.
    the trainable parameters, ``H`` the loss Hessian w.r.t. the output.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() for p in params]
    outputs = model(X)
    loss = loss_function(outputs, y)
    # gradient w.r.t. the output, kept differentiable for Hessian-vector products
    (output_grad,) = torch.autograd.grad(loss, outputs, create_graph=True)
    # Jᵀu as a function of a dummy u: differentiating it w.r.t. u gives J v
    dummy = torch.zeros_like(outputs, requires_grad=True)
    vjps = torch.autograd.grad(
        outputs, params, grad_outputs=dummy, create_graph=True, allow_unused=True
    )
    indices = range(sum(sizes)) if idx is None else [int(d) for d in idx]
    entries = []
    for d in indices:
        e_d = torch.zeros(sum(sizes), dtype=outputs.dtype, device=outputs.device)
        e_d[d] = 1.0
        e_d_list = [v.view_as(p) for v, p in zip(e_d.split(sizes), params)]
        used = [(vjp, v) for vjp, v in zip(vjps, e_d_list) if vjp is not None]
        (jvp,) = torch.autograd.grad(
            [u for u, _ in used], dummy, grad_outputs=[v for _, v in used], retain_graph=True
        )
        (hjvp,) = torch.autograd.grad(output_grad, outputs, grad_outputs=jvp, retain_graph=True)
        entries.append((jvp * hjvp).sum().detach())
    return torch.stack(entries)


def make_examples_module(package: str) -> types.ModuleType:
    """A module to inject as ``<package>.utils.examples``."""
    module = types.ModuleType(f"{package}.utils.examples", __doc__)
    for function in (
        load_mnist_dataset,
        get_mnist_dataloader,
        load_one_batch_mnist,
        autograd_diag_ggn_exact,
    ):
        setattr(module, function.__name__, function)
    return module


# ---------------------------------------------------------------------------
# The examples
# ---------------------------------------------------------------------------


def _const(name: str, old: str, new: str) -> tuple[str, str]:
    """Substitution of a module-level constant ``name = old`` by ``name = new``."""
    return rf"^{name} = {re.escape(old)}$", f"{name} = {new}"


EXAMPLES: tuple[Example, ...] = (
    Example("all_in_one", "basic_usage/example_all_in_one.py"),
    Example("custom_module", "use_cases/example_custom_module.py", requires=("einops",)),
    # example_first_order_resnet.py only points to example_resnet_all_in_one.py, where
    # its content moved; run the latter up to its torchvision section (resnet18 and the
    # converter), which needs torchvision.
    Example(
        "first_order_resnet",
        "use_cases/example_resnet_all_in_one.py",
        (
            (r"^from torchvision\.models import resnet18\n", ""),
            (r"^# %%\n# Any ResNet with BackPACK's converter\n(?s:.*)", ""),
        ),
    ),
    Example("first_order_resnet_stub", "use_cases/example_first_order_resnet.py"),
    Example("extension_hook", "use_cases/example_extension_hook.py", prints_checks=True),
    Example(
        "retain_graph",
        "use_cases/example_retain_graph.py",
        (
            # 8 x 8 instead of 32 x 32 images: output dimension 192, still divisible by
            # every number of chunks
            (r"^(batch_size, channels, spatial_dims = 5, 3,) \(32, 32\)$", r"\1 (8, 8)"),
        ),
        requires=("memory_profiler",),
    ),
    Example(
        "gradient_of_variance", "use_cases/example_gradient_of_variance.py", prints_checks=True
    ),
    Example("subsampling", "use_cases/example_subsampling.py"),
    Example(
        "batched_jacobians", "use_cases/example_batched_jacobians.py", requires=("matplotlib",)
    ),
    Example(
        "cg_newton",
        "use_cases/example_cg_newton.py",
        (
            _const("BATCH_SIZE", "64", "16"),
            _const("MAX_ITER", "50", "0"),  # each training loop stops after MAX_ITER + 2 steps
            _const("CG_MAX_ITER", "20", "1"),  # CG stops after CG_MAX_ITER + 1 products
        ),
        requires=("matplotlib",),
    ),
    Example(
        "diag_ggn_optimizer",
        "use_cases/example_diag_ggn_optimizer.py",
        (_const("MAX_ITER", "200", "2"),),
        requires=("matplotlib",),
    ),
    Example(
        "differential_privacy",
        "use_cases/example_differential_privacy.py",
        (_const("MAX_ITER", "200", "2"),),
        requires=("matplotlib",),
    ),
    Example("rnn", "use_cases/example_rnn.py", requires=("tabulate",)),  # print_tabular
    # needs BackPACK's internal backpack.core.derivatives.convnd (not a public path)
    Example(
        "save_memory_convolutions",
        "use_cases/example_save_memory_convolutions.py",
        ((r"load_one_batch_mnist\(batch_size=64\)", "load_one_batch_mnist(batch_size=8)"),),
        requires=("memory_profiler",),
    ),
    Example(
        "trace_estimation",
        "use_cases/example_trace_estimation.py",
        (
            (r"\bV=1000\b", "V=20"),  # Hutchinson samples
            _const("V", "1000", "20"),
            _const("V_steps", "30", "3"),  # points on the convergence plot ...
            (r"logspace\(1, 3, ", "logspace(1, 2, "),  # ... from 10 to 100 samples
            _const("num_curves", "15", "2"),
        ),
        requires=("matplotlib",),
    ),
    # example_resnet_all_in_one.py in full needs torchvision (never installed here).
)

# A failed check that an example only prints ("Same Tr(H)? False")
FAILED_CHECK = re.compile(r"\bFalse\b")
