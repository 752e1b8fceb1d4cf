"""State dicts with the released checkpoints' tensor names, from and to safetensors files.

A module's checkpoint names are its `nnx.Param` paths joined with dots, the parameters being
stored in the PyTorch layout (see `layers.py`); the Markov head's two factors, which DeepSpec keeps
as `nn.Embedding` / `nn.Linear` modules, get the `.weight` suffix: `markov_head.markov_w1.weight`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_WEIGHT_SUFFIXED = ("markov_w1", "markov_w2")
_MAX_LISTED = 12


class CheckpointError(ValueError):
    """A state dict does not fit the module: missing, unexpected or misshaped tensors."""


@dataclasses.dataclass
class LoadReport:
    loaded: list[str]
    skipped: list[str]  # tensors recognised but not loaded (shared with the target)
    missing: list[str]  # only non-empty with strict=False
    unexpected: list[str]  # only non-empty with strict=False


def _name(path) -> str:
    name = ".".join(str(p) for p in path)
    if path and path[-1] in _WEIGHT_SUFFIXED:
        name += ".weight"
    return name


def parameters(module: nnx.Module) -> dict[str, nnx.Variable]:
    """{checkpoint name: the nnx.Param holding it} for every parameter of the module."""
    out = {}
    for path, _ in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        var = module
        for p in path:
            var = var[p] if isinstance(p, int) else getattr(var, p)
        out[_name(path)] = var
    return out


def state_dict(module: nnx.Module, *, prefix: str = "", dtype=None) -> dict[str, jax.Array]:
    """{checkpoint name: array} (optionally cast to dtype), ready for `save_safetensors`."""
    out = {}
    for name, var in parameters(module).items():
        value = var[...]
        out[prefix + name] = value if dtype is None else value.astype(dtype)
    return out


def _listing(kind: str, names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    more = f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return f"{kind} ({len(names)}): {shown}{more}"


def _shape(value) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(value))


def load_state_dict(module: nnx.Module, tensors: Mapping[str, object], *, prefix: str = "", strict: bool = True,
                    shared: Mapping[str, tuple[int, ...]] | None = None, what: str | None = None) -> LoadReport:
    """Load {name: array} into the module's parameters, in place.

    prefix: only names that start with it are considered (and it is stripped), so a head can be
      loaded from a whole drafter checkpoint with prefix="markov_head.".
    strict: every parameter must be present and no other name may appear (under the prefix);
      a misshaped tensor is always an error. All problems are reported in one CheckpointError.
    shared: names that are recognised but not loaded (e.g. the target's embedding and LM head that
      a drafter checkpoint may carry), with their expected shapes (checked).
    Values are cast to each parameter's dtype. Submodules with an `after_load()` method (the Markov
    head: it rebuilds its int8 layout) are called once everything is in.
    """
    what = what or type(module).__name__
    shared = dict(shared or {})
    params = parameters(module)
    given = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing = [n for n in params if n not in given]
    unexpected = [n for n in given if n not in params and n not in shared]
    misshaped = []
    for n, v in given.items():
        expected = tuple(params[n].shape) if n in params else shared.get(n)
        if expected is not None and _shape(v) != tuple(expected):
            misshaped.append(f"{prefix}{n}: expected {list(expected)}, got {list(_shape(v))}")
    problems = []
    if misshaped:
        problems.append(_listing("misshaped", misshaped))
    if strict and missing:
        problems.append(_listing("missing", [prefix + n for n in missing]))
    if strict and unexpected:
        problems.append(_listing("unexpected", [prefix + n for n in unexpected]))
    if problems:
        raise CheckpointError(f"checkpoint does not fit {what}: " + "; ".join(problems))
    loaded = []
    for n, var in params.items():
        if n in given:
            var[...] = jnp.asarray(given[n]).astype(var.dtype)
            loaded.append(prefix + n)
    for _, sub in nnx.iter_modules(module):
        hook = getattr(sub, "after_load", None)
        if callable(hook):
            hook()
    return LoadReport(loaded=loaded, skipped=[prefix + n for n in given if n in shared],
                      missing=[prefix + n for n in missing], unexpected=[prefix + n for n in unexpected])


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file, a directory of them (shards) or a *.index.json. A file that
    cannot be read or is not a valid safetensors file is a CheckpointError naming it."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            return read_safetensors(index)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors file in {path}")
        paths = [os.path.join(path, f) for f in files]
    elif path.endswith(".index.json"):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:  # ValueError: not JSON; KeyError: no weight_map
            raise CheckpointError(f"cannot read the safetensors index {path}: {e!r}") from e
        base = os.path.dirname(path)
        paths = [os.path.join(base, f) for f in sorted(set(weight_map.values()))]
    else:
        paths = [path]
    out = {}
    for p in paths:
        try:
            tensors = load_file(p)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read the safetensors file {p}: {e}") from e
        for name, value in tensors.items():
            if name in out:
                raise CheckpointError(f"tensor {name} appears in more than one shard ({p})")
            out[name] = value
    return out


def load_safetensors(module: nnx.Module, path: str | os.PathLike, **kwargs) -> LoadReport:
    """`load_state_dict(module, read_safetensors(path), **kwargs)`."""
    return load_state_dict(module, read_safetensors(path), **kwargs)


def save_safetensors(module: nnx.Module, path: str | os.PathLike, *, prefix: str = "", dtype=None,
                     metadata: Mapping[str, str] | None = None, extra: Mapping[str, object] | None = None):
    """Write the module's parameters under their checkpoint names (plus `extra` tensors)."""
    from safetensors.numpy import save_file

    tensors = {k: np.asarray(v) for k, v in state_dict(module, prefix=prefix, dtype=dtype).items()}
    for k, v in (extra or {}).items():
        tensors[k] = np.asarray(v)
    save_file(tensors, os.fspath(path), metadata=dict(metadata or {"format": "pt"}))
