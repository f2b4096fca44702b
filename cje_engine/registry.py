"""One registry for every family of plug-ins (calibration modes, labelling tools, notifiers, importers).

A family is a `Registry`: named entries in registration order, each checked when it is registered (not at
its first use), looked up by name with an error that names the choices and the closest one. The family's
module keeps its protocol and its check; the bookkeeping (register, replace, unregister, names, get) is
here once.

Examples
--------
>>> tools = Registry("labelling tool", check=lambda t: None)
>>> _ = tools.register(type("T", (), {"name": "csv"})())
>>> tools.names()
('csv',)
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from cje_engine.errors import CJEInputError, did_you_mean

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one family, in registration order.

    Parameters
    ----------
    family : str
        What an entry is, in messages (``"calibration mode"``, ``"labelling tool"``).
    check : callable, optional
        Called with each entry before it is registered; raises `ValueError` or `TypeError` when the entry
        does not follow the family's protocol (its name included).
    option : str, optional
        The option or flag the names are values of; `get`'s error names it.
    """

    def __init__(self, family: str, check: Callable[[T], None] | None = None, option: str | None = None) -> None:
        self.family = family
        self.check = check
        self.option = option
        self._entries: dict[str, T] = {}

    def register(self, entry: T, *, replace: bool = False) -> T:
        """Add ``entry`` under its ``name`` (returned, so that it can decorate an instance).

        Parameters
        ----------
        entry : T
            The entry; ``entry.name`` is its key.
        replace : bool
            Replace an entry of the same name (default: a second registration is an error).

        Raises
        ------
        ValueError, TypeError
            The family's check failed, or the name is taken.
        """
        if self.check is not None:
            self.check(entry)
        name = getattr(entry, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.family} needs a non-empty string name; got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self.family} {name!r} is already registered ({type(self._entries[name]).__name__})")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` if registered (tests register toys and remove them again)."""
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def entries(self) -> tuple[T, ...]:
        """The registered entries, in registration order."""
        return tuple(self._entries.values())

    def items(self) -> tuple[tuple[str, T], ...]:
        """``(name, entry)`` pairs, in registration order."""
        return tuple(self._entries.items())

    def get(self, name: str, choices: tuple[str, ...] | None = None, what: str | None = None) -> T:
        """The entry ``name``.

        Parameters
        ----------
        name : str
            The name asked for.
        choices : tuple of str, optional
            The names acceptable here (default: all); a narrower family such as "labelling tool with a
            server".
        what : str, optional
            The narrower family's name for the error (default: the family).

        Raises
        ------
        CJEInputError
            Not among ``choices``: the message names them and the closest.
        """
        choices = self.names() if choices is None else choices
        if isinstance(name, str) and name in choices:
            return self._entries[name]
        option = {"option": self.option} if self.option else {}
        raise CJEInputError(f"unknown {what or self.family} {name!r}; expected one of {list(choices)}"
                            + did_you_mean(name, choices), **option)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<{self.family} registry: {', '.join(self._entries) or 'empty'}>"
