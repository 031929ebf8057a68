"""``pb_utils.ModelConfig`` (what ``auto_complete_config`` edits) and the config lookup helpers.

The configuration is the JSON form of Triton's ``ModelConfig`` message with proto field names,
every field present and 64-bit integers as numbers (see :func:`tideserve.config.to_dict`).
"""

from __future__ import annotations

import json
from typing import Any


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class ModelConfig:
    """The model configuration as ``auto_complete_config`` sees it.

    ``add_input``, ``add_output``, ``set_max_batch_size``, ``set_dynamic_batching`` and
    ``set_model_transaction_policy`` fill in what the configuration file leaves out, and refuse
    to contradict what it says. ``as_dict()`` gives the configuration as a dict.
    """

    def __init__(self, model_config: str | dict) -> None:
        self._model_config = json.loads(model_config) if isinstance(model_config, (str, bytes)) else model_config
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    @property
    def _name(self) -> str:
        return self._model_config.get("name", "")

    def as_dict(self) -> dict:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = self._model_config.get("max_batch_size", 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config function for "
                f"model '{self._name}' specified max_batch_size {max_batch_size}")
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if scheduler in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{scheduler}', but auto-complete-config "
                    f"function for model '{self._name}' tries to set scheduling_choice as 'dynamic_batching'")
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict) -> None:
        self._add_tensor("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add_tensor("output", output, ("name", "data_type", "dims"))

    def _add_tensor(self, kind: str, tensor: dict, allowed: tuple[str, ...]) -> None:
        name = tensor.get("name")
        extra = [key for key in tensor if key not in allowed]
        if extra:
            raise ValueError(
                f"{kind} '{name}' in auto-complete-config function for model '{self._name}' contains property "
                f"other than {', '.join(repr(a) for a in allowed)}.")
        if name is None:
            raise ValueError(f"{kind} in auto-complete-config function for model '{self._name}' is missing "
                             f"'name' property.")
        for required in ("data_type", "dims"):
            if required not in tensor:
                raise ValueError(f"{kind} '{name}' in auto-complete-config function for model '{self._name}' "
                                 f"is missing '{required}' property.")
        for current in self._model_config[kind]:
            if current.get("name") != name:
                continue
            self._merge(kind, current, tensor)
            return
        self._model_config[kind].append(dict(tensor))

    def _merge(self, kind: str, current: dict, tensor: dict) -> None:
        name = tensor["name"]
        data_type = current.get("data_type", "TYPE_INVALID")
        if data_type != "TYPE_INVALID" and data_type != tensor["data_type"]:
            raise ValueError(
                f"unable to load model '{self._name}', configuration expects datatype {data_type} for {kind} "
                f"'{name}', model provides {tensor['data_type']}")
        dims = current.get("dims") or []
        if dims and list(dims) != list(tensor["dims"]):
            raise ValueError(
                f"model '{self._name}', tensor '{name}': the model expects dims {list(tensor['dims'])} but the "
                f"model configuration specifies dims {list(dims)}")
        if "optional" in tensor and "optional" in current and current["optional"] != tensor["optional"]:
            raise ValueError(
                f"model '{self._name}', tensor '{name}': the model expects optional {tensor['optional']} but "
                f"the model configuration specifies optional {current['optional']}")
        current["data_type"] = tensor["data_type"]
        current["dims"] = list(tensor["dims"])
        if "optional" in tensor:
            current["optional"] = tensor["optional"]

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        extra = [key for key in transaction_policy_dict if key != "decoupled"]
        if extra:
            raise ValueError(f"model transaction property in auto-complete-config function for model "
                             f"'{self._name}' contains property other than 'decoupled'.")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            # A config that leaves the policy unset reads as decoupled: false; Triton lets
            # auto-complete turn it on then, and refuses only to change an explicit setting.
            if policy.get("decoupled") and policy["decoupled"] != wanted:
                raise ValueError(f"trying to change decoupled property in auto-complete-config for model "
                                 f"'{self._name}', which is already set to '{policy['decoupled']}'.")
            policy["decoupled"] = wanted
