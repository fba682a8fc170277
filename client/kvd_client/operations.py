"""One method for both clients: @operation, and the two runners it makes methods for.

An operation is written once, as a method that returns the call (calls.py) it runs. On a
BlockingRunner (Client, Ticket, LookupResult) @operation makes of it a method that drives
the call to its end and returns the result; on an AsyncRunner (AsyncClient, AsyncTicket,
AsyncLookupResult), a coroutine method with the same result. Both wear the written method's
name, docstring and parameters, and mypy types each as it runs (the overloads of __get__).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import update_wrapper
from types import MethodType
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

from .calls import Call

T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S")  # what the operation is a method of


class RunsBlocking(Protocol):
    def __call__(self, call: Call[T]) -> T: ...


class RunsAwaiting(Protocol):
    def __call__(self, call: Call[T]) -> Coroutine[Any, Any, T]: ...


class BlockingRunner:
    """Drives the calls of its operations to their end: they return their results."""

    _awaits: ClassVar[bool] = False
    _run: RunsBlocking


class AsyncRunner:
    """Drives the calls of its operations on the event loop: they return coroutines."""

    _awaits: ClassVar[bool] = True
    _run: RunsAwaiting


class operation(Generic[S, P, T]):  # noqa: N801 - a decorator, as property is
    """A method of a BlockingRunner and of an AsyncRunner, written once as the call it runs."""

    def __init__(self, call: Callable[Concatenate[S, P], Call[T]]) -> None:
        def blocking(runner: Any, *args: Any, **kwargs: Any) -> Any:
            return runner._run(call(runner, *args, **kwargs))

        async def awaiting(runner: Any, *args: Any, **kwargs: Any) -> Any:
            return await runner._run(call(runner, *args, **kwargs))

        # By the runner's _awaits: the method it gets.
        self._methods = (update_wrapper(blocking, call), update_wrapper(awaiting, call))

    @overload
    def __get__(
        self, runner: None, owner: type[BlockingRunner]
    ) -> Callable[Concatenate[S, P], T]: ...

    @overload
    def __get__(
        self, runner: None, owner: type[AsyncRunner]
    ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]: ...

    @overload
    def __get__(self, runner: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(self, runner: BlockingRunner, owner: type[Any]) -> Callable[P, T]: ...

    @overload
    def __get__(
        self, runner: AsyncRunner, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...

    def __get__(self, runner: BlockingRunner | AsyncRunner | None, owner: type[Any]) -> Any:
        if runner is not None:
            return MethodType(self._methods[runner._awaits], runner)
        awaits: bool | None = getattr(owner, "_awaits", None)  # None: the class written once
        return self if awaits is None else self._methods[awaits]
