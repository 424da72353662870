"""A reward function of the user's own, given as a Python file and a function name
(`reward.custom_function.path` / `.name`; verl's `custom_reward_function.path` / `.name`).

The function has verl's signature and is called by keyword, as verl calls it:

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | bool | dict

data_source and extra_info are the prompt row's (`extra_info` a dict, {} when the row has none);
ground_truth is the row's reward_model.ground_truth as text. It returns a real number (the score), a bool
(right: score 1, wrong: 0) or a dict with at least "score" (and optionally "acc", a bool, and "pred"; any
other key is kept per row, logged as reward_extra/<key>/mean when numeric and written to the dumps). It runs where the built-in
functions run (in the reward workers, with reward.timeout_s, reward.on_error and the same named errors):
`CustomRewardFn` pickles as its path and name, and each worker loads the file once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import numbers
import os
import sys
from collections.abc import Mapping


class CustomRewardError(ValueError):
    """The file cannot be loaded or does not define the function; the message names which."""


class CustomRewardFn:
    """`name` from the Python file `path`, as a reward manager score function (see the module docstring)."""

    takes_row_info = True  # the reward manager passes data_source and extra_info to it

    def __init__(self, path: str, name: str = "compute_score"):
        self.path, self.name = os.path.abspath(path), name
        self._fn = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["name"])

    def __repr__(self) -> str:
        return f"CustomRewardFn({self.path!r}, {self.name!r})"

    def load(self):
        """Import the file (once per process) and return the function; CustomRewardError if it cannot."""
        if self._fn is not None:
            return self._fn
        if not os.path.isfile(self.path):
            raise CustomRewardError(f"{self.path}: no such file")
        module_name = "megatron_dapo_custom_reward_" + hashlib.sha256(self.path.encode()).hexdigest()[:16]
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, self.path)
            if spec is None or spec.loader is None:
                raise CustomRewardError(f"{self.path}: not a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # what the function returns stays picklable (pred objects)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[module_name]
                raise CustomRewardError(f"{self.path}: importing it raised {type(exc).__name__}: {exc}") from exc
        fn = getattr(module, self.name, None)
        if not callable(fn):
            defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                             and getattr(v, "__module__", None) == module_name)
            raise CustomRewardError(f"{self.path} defines no function {self.name!r} (its functions: {defined})")
        self._fn = fn
        return fn

    def __call__(self, solution_str: str, ground_truth, *, data_source: str | None = None,
                 extra_info: Mapping | None = None):
        result = self.load()(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                             extra_info=dict(extra_info or {}))
        if type(result).__module__ == "numpy" and hasattr(result, "item"):
            result = result.item()  # a numpy scalar (np.float64, np.bool_) as the Python value it holds
        if isinstance(result, bool):  # right or wrong: verl scores it as 1 / 0
            return {"score": float(result), "acc": result}
        if isinstance(result, numbers.Real):
            return {"score": result}
        return result  # a dict is checked by the reward manager like any reward function's
