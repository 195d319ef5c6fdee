"""One signature per family: the forward's. The backward (``grad_out`` first, then the
forward's arguments), the torch adapter's wrappers and the reference's twin in
:mod:`attnlab.reference` are generated from it, so a new keyword argument is written once, in
the forward's ``def``, and every derived function takes it.

Generated functions are ordinary Python functions (compiled from source, as ``dataclasses``
builds ``__init__``): ``inspect.signature``, ``help()``, tab completion and Python's own
argument errors see the real parameters, names, defaults and annotations. Static tools see
them too: :func:`backward_of` and :func:`reference_of` are typed with the forward's
``ParamSpec``, so mypy rejects a misspelt keyword and an editor's hover lists the forward's
parameters (a backward's first, positional, being ``grad_out``)."""

from __future__ import annotations

import inspect
import linecache
import os
import textwrap
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from . import _docs

__all__: list[str] = []  # private module

_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep

T = TypeVar("T")
P = ParamSpec("P")


def arguments(local_vars: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a call by name, from ``locals()`` taken first thing in the function
    (then they are exactly its parameters)."""
    return dict(local_vars)


def public_parameters(f: Callable[..., Any]) -> list[inspect.Parameter]:
    """``f``'s parameters but the private ones (``_keep``, ``_order``: attnlab's own)."""
    return [p for p in inspect.signature(f).parameters.values() if not p.name.startswith("_")]


def hide_private(f: Callable[..., Any]) -> None:
    """Give ``f`` the signature of its public parameters only, the one ``help()``,
    ``inspect.signature`` and the documentation show (its private ones stay callable)."""
    sig = inspect.signature(f)
    setattr(f, "__signature__", sig.replace(parameters=public_parameters(f)))  # noqa: B010


def name_list(
    f: Callable[..., Any], *, but: Iterable[str] = (), params: list[inspect.Parameter] | None = None
) -> str:
    """The names of ``f``'s public parameters (or of ``params``) but those in ``but``, in
    order, as a docstring lists them: ``a, b, c`` wrapped to lines of 88 characters. Generated,
    so that a docstring naming the parameters of a forward takes a new one as it is added."""
    skip = set(but)
    names = [p.name for p in (public_parameters(f) if params is None else params)]
    return "\n".join(textwrap.wrap(", ".join(n for n in names if n not in skip), 88))


def generate(
    name: str,
    module: str,
    params: list[inspect.Parameter],
    returns: str,
    doc: str | None,
    body: Callable[..., Any],
    *,
    first: str | None = None,
    annotations: Mapping[str, str] | None = None,
) -> Callable[..., Any]:
    """A function ``name(first, <params>) -> returns`` whose body is
    ``return body(first, {param: value, ...})`` (without ``first``: ``body({...})``).

    ``annotations`` overrides the annotation (a string) of the parameters it names. The
    function reports ``module`` as its own and lives, for tracebacks and for the warnings'
    ``stacklevel`` (see ``_validate.user_stacklevel``), in a file name inside the package."""
    annotations = annotations or {}
    namespace: dict[str, Any] = {"__body": body}
    parts: list[str] = [] if first is None else [f"{first}: Any"]
    star = False
    for p in params:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):  # never in attnlab's API
            raise TypeError(f"{name}: cannot generate parameter {p} ({p.kind.description})")
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        ann = annotations.get(p.name, p.annotation)
        text = p.name if ann is p.empty else f"{p.name}: {ann}"
        if p.default is not p.empty:
            namespace[f"__d_{p.name}"] = p.default
            text += f" = __d_{p.name}"
        parts.append(text)
    call = "{" + ", ".join(f"{p.name!r}: {p.name}" for p in params) + "}"
    head = "" if first is None else f"{first}, "
    source = (
        f"from __future__ import annotations\n"
        f"def {name}({', '.join(parts)}) -> {returns}:\n"
        f"    return __body({head}{call})\n"
    )
    filename = f"{_PKG}<generated {module}.{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)  # the source is built above
    fn: Callable[..., Any] = namespace[name]
    fn.__module__ = module
    fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


def backward_of(
    forward: Callable[P, Any],
    body: Callable[[Any, dict[str, Any]], Any],
    output: str,
    doc: str,
    *,
    wrt: str = "every array argument given",
    intro: str = "",
) -> Callable[Concatenate[Any, P], dict[str, np.ndarray]]:
    """``<forward>_backward(grad_out, <forward's public arguments>)``: ``body(grad_out,
    arguments)`` computes the gradients.

    Its docstring starts as every backward's does (what it differentiates, an optional
    ``intro`` paragraph, ``grad_out`` of shape ``output``), then ``doc``: the other
    parameters, the returns, the examples, with :mod:`attnlab._docs`' fragments filled in and
    ``{forward_parameters}`` standing for the list of the forward's parameters but
    ``return_weights`` (which a backward accepts and ignores)."""
    head = (
        f"Gradients of :func:`{forward.__name__}` with respect to {wrt}.\n\n{intro}"
        f"    Parameters\n    ----------\n    grad_out : array_like, shape {output}\n"
        f"        Gradient of the loss with respect to the output.\n"
    )
    return generate(
        f"{forward.__name__}_backward",
        forward.__module__,
        public_parameters(forward),
        "dict[str, np.ndarray]",
        _docs.fill(head + doc, {"forward_parameters": name_list(forward, but=("return_weights",))}),
        body,
        first="grad_out",
    )


def reference_of(
    forward: Callable[P, Any],
) -> Callable[[Callable[[dict[str, Any]], T]], Callable[P, T]]:
    """Decorator of a reference function's body ``name(args)``: the function
    ``name(<forward's public parameters>)`` that calls ``body({param: value, ...})``.

    Only the parameters are ``forward``'s (names, kinds, defaults, annotations); the body
    computes the result its own way. The function takes the body's name (``forward``'s),
    module, return annotation and docstring, with :mod:`attnlab._docs`' fragments filled in and
    ``{parameters}`` standing for a Parameters section that lists the parameters and refers to
    ``attnlab.<forward>`` for their meaning."""
    params = public_parameters(forward)
    names = name_list(forward, params=params)
    section = (
        f"Parameters\n----------\n{names}\n    As for :func:`attnlab.{forward.__name__}`, from "
        f"whose signature this function takes them."
    )

    def decorate(body: Callable[[dict[str, Any]], T]) -> Callable[P, T]:
        if body.__name__ != forward.__name__:
            raise TypeError(f"reference_of({forward.__name__}): the body is {body.__name__}")
        returns = inspect.signature(body).return_annotation
        # attnlab's modules postpone their annotations: each is the text written in the ``def``
        returns = returns if isinstance(returns, str) else "Any"
        doc = _docs.fill(body.__doc__ or "", {"parameters": section})
        fn: Callable[P, T] = generate(body.__name__, body.__module__, params, returns, doc, body)
        return fn

    return decorate
