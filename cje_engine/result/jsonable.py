"""Plain JSON data from numpy-laden Python objects (the engine's one JSON cleaner)."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np


def jsonable(x: Any, default: Callable[[Any], Any] | None = None) -> Any:
    """Numpy scalars and arrays to Python, NaN/inf to None, tuples to lists, keys to str.

    Parameters
    ----------
    x : any
    default : callable, optional
        Applied to objects that are not JSON data (e.g. ``str`` for timestamps); without it
        they are returned unchanged.
    """
    if isinstance(x, dict):
        return {str(k): jsonable(v, default) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, default) for v in x]
    if isinstance(x, np.ndarray):
        return [jsonable(v, default) for v in x.tolist()]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return v if math.isfinite(v) else None
    if x is None or isinstance(x, str) or default is None:
        return x
    return default(x)
