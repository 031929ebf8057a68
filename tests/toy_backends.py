"""Toy backends for in-process tests of the core (repository, schedulers, DataPlane).

They are real backends written against the backend API, registered programmatically instead of
through entry points. Behaviour comes from config parameters:
``delay_ms`` (sleep per execute), ``fail`` (raise in execute), ``gate`` (wait on a named event).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from tideserve.backend import Backend, BackendRegistry, Model
from tideserve.batching import TensorModelInstance
from tideserve.dataplane import DataPlane
from tideserve.repository import ControlMode, ModelRepository
from tideserve.stats import Metrics
from tideserve.types import InferenceRequest, Tensor

BATCHES: dict[str, list[list[int]]] = defaultdict(list)   # model -> list of batches (request ids as ints)
GATES: dict[str, threading.Event] = {}


class SumInstance(TensorModelInstance):
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, recording each batch it runs."""

    def execute(self, requests):
        params = self.model.ctx
        BATCHES[params.name].append([int(r.id) if r.id.isdigit() else -1 for r in requests])
        gate = params.parameter("gate")
        if gate:
            GATES.setdefault(gate, threading.Event()).wait(10)
        delay = float(params.parameter("delay_ms", "0"))
        if delay:
            time.sleep(delay / 1000)
        if params.parameter("fail"):
            raise RuntimeError("toy model failure: " + params.parameter("fail"))
        return super().execute(requests)

    def infer(self, inputs):
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}


class ToyModel(Model):
    instance_class = SumInstance

    def initialize(self):
        if self.ctx.parameter("fail_load"):
            raise RuntimeError("toy model refuses to load: " + self.ctx.parameter("fail_load"))


class ToyBackend(Backend):
    model_class = ToyModel


def instance_backend(instances, key: str = "kind") -> type[Backend]:
    """A toy backend for a test file's own instance behaviours: its models make ``instances`` (one
    ModelInstance class, or a dict from the model's ``key`` parameter, else its name, to a class)."""

    def pick(model: Model) -> type:
        if isinstance(instances, dict):
            return instances[model.ctx.parameter(key, model.ctx.name)]
        return instances

    class _Model(Model):
        def create_instance(self, ctx):
            return pick(self)(self, ctx)

    class _Backend(Backend):
        model_class = _Model

    return _Backend


def toy_registry() -> BackendRegistry:
    registry = BackendRegistry()
    registry.register("toy", ToyBackend)
    return registry


SUM_CONFIG = """
backend: "toy"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {dims} ] {ragged} }},
        {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ {dims} ] {ragged} }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }},
         {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
{extra}
"""


def write_model(repo: Path, name: str, *, max_batch_size: int = 8, dims: str = "4", instances: int = 1,
                extra: str = "", ragged: bool = False, params: dict | None = None, versions=(1,)) -> Path:
    model_dir = repo / name
    for version in versions:
        (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    text = SUM_CONFIG.format(max_batch_size=max_batch_size, dims=dims, instances=instances, extra=extra,
                             ragged="allow_ragged_batch: true" if ragged else "")
    for key, value in (params or {}).items():
        text += f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir


async def start_core(repo: Path, mode: ControlMode = ControlMode.NONE, load=(),
                     registry: BackendRegistry | None = None) -> DataPlane:
    """A started core over ``repo`` (its repository: ``dataplane.repository``), the toy backends' registry or
    ``registry``."""
    metrics = Metrics()
    repository = ModelRepository([repo], registry or toy_registry(), metrics, mode, list(load))
    dataplane = DataPlane(repository, metrics)
    repository.handles = dataplane.server_handles()
    await repository.start()
    return dataplane


def sum_request(model: str, rid: int | str, rows: int = 1, width: int = 4, value: float = 1.0, **kw) -> InferenceRequest:
    a = np.full((rows, width), value, np.float32)
    b = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    return InferenceRequest(model, {"INPUT0": Tensor.from_numpy("INPUT0", a),
                                    "INPUT1": Tensor.from_numpy("INPUT1", b)}, id=str(rid), **kw)


async def collect(dataplane: DataPlane, request: InferenceRequest):
    """All responses of one request."""
    return [r async for r in dataplane.infer(request)]


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
