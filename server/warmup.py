"""Model warmup: the config's ``model_warmup`` samples run on every instance before the model is READY.

As Triton: a sample of ``batch_size`` N is N requests of batch 1 run as one batch (a sample with
``batch_size: 0`` is skipped), ``count`` times (at least once). Each input is ``zero_data``,
``random_data`` (zeros for strings) or ``input_data_file`` (raw row-major bytes, or serialized
strings, read from ``<model>/warmup/``); its ``dims`` exclude the batch dimension of a batching
model and must all be fixed. An input that is not a model input (a sequence control, a state) is
passed to the model as given (with the batch dimension of a batching model). Samples are checked
against the config like client requests, and a sample that is malformed, fails validation or gets
an error from the model fails the load, naming the sample. Logged as Triton logs it (at ``--log-verbose 1``):
"model 'M' instance I is running warmup sample 'S' for iteration N" before each run, and a failure is
"failed to run warmup sample 'S': <error>; ..." (each response's error followed by "; ").
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .datatypes import config_to_datatype, element_size, from_raw, numpy_dtype
from .errors import InvalidArgument, ServerError
from .responses import ResponseSender
from .types import InferenceRequest, InferenceResponse, Tensor

log = logging.getLogger(__name__)

WARMUP_FOLDER = "warmup"  # <model>/warmup/<input_data_file>, as Triton reads it


def build_samples(config: mc.ModelConfig, model_path: Path, check_file=None) -> list[tuple[str, int, list[dict]]]:
    """(sample name, runs, one input dict per request) for each sample; InvalidArgument if malformed."""
    samples = []
    batched = config.max_batch_size > 0
    for setting in config.model_warmup:
        if setting.batch_size == 0:
            continue
        where = f"model '{config.name}': warmup sample '{setting.name}'"
        if setting.batch_size > max(config.max_batch_size, 1):
            raise InvalidArgument(f"{where} has batch_size {setting.batch_size}, more than the model's "
                                  f"max_batch_size {max(config.max_batch_size, 1)}")
        tensors = {}
        for name, spec in setting.inputs.items():
            shape = ((1,) if batched else ()) + tuple(spec.dims)
            tensors[name] = _sample_input(where, name, spec, shape, model_path, check_file)
        samples.append((setting.name, max(setting.count, 1), [dict(tensors) for _ in range(setting.batch_size)]))
    return samples


def _sample_input(where: str, name: str, spec, shape: tuple[int, ...], model_path: Path, check_file) -> Tensor:
    if any(d < 0 for d in spec.dims):
        raise InvalidArgument(f"{where}: warmup setting expects all variable-size dimensions are specified for "
                              f"input '{name}', got dims {list(spec.dims)}")
    if spec.data_type == mc.TYPE_INVALID:
        raise InvalidArgument(f"{where}: input '{name}' must set data_type")
    datatype = config_to_datatype(mc.DataType.Name(spec.data_type))
    which = spec.WhichOneof("input_data_type")
    count = math.prod(shape)
    if which == "zero_data" or (which == "random_data" and datatype == "BYTES"):
        if datatype == "BYTES":
            data = np.empty(shape, dtype=np.object_)
            data.fill(b"")
        else:
            data = np.zeros(shape, dtype=numpy_dtype(datatype))
    elif which == "random_data":
        raw = np.random.default_rng().integers(0, 256, count * element_size(datatype), dtype=np.uint8)
        data = np.frombuffer(raw.tobytes(), dtype=numpy_dtype(datatype)).reshape(shape).copy()
        if data.dtype.kind == "f":  # random bytes may spell NaN or infinity; keep the values finite
            data = np.nan_to_num(data, nan=0.0, posinf=0.0, neginf=0.0)
        if data.dtype == np.bool_:
            data = data.astype(np.uint8).astype(np.bool_)
    elif which == "input_data_file":
        data = _read_file(where, name, spec.input_data_file, datatype, shape, model_path, check_file)
    else:
        raise InvalidArgument(f"{where}: input '{name}' must set zero_data, random_data or input_data_file")
    return Tensor(name, datatype, shape, data)


def _read_file(where: str, name: str, data_file: str, datatype: str, shape: tuple[int, ...], model_path: Path,
               check_file) -> np.ndarray:
    path = model_path / WARMUP_FOLDER / data_file
    if check_file is not None:
        path = check_file(path, f"{where.split(': ', 1)[-1]} input '{name}' input_data_file", data_file)
    if not path.is_file():
        raise InvalidArgument(f"{where}: input '{name}' input_data_file '{data_file}' is not a file in "
                              f"'{model_path / WARMUP_FOLDER}'")
    raw = path.read_bytes()
    if datatype != "BYTES":
        needed = math.prod(shape) * element_size(datatype)
        if len(raw) < needed:
            raise InvalidArgument(f"{where}: warmup setting expects {needed} bytes for input '{name}', but the "
                                  f"data provided from '{data_file}' only has {len(raw)} bytes")
        raw = raw[:needed]
    try:
        return from_raw(raw, datatype, shape, name)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: input_data_file '{data_file}': {exc}") from None


async def run_warmup(runtime) -> None:
    """Run every sample on every instance of ``runtime``; raise InvalidArgument naming a failure."""
    config = runtime.config
    if not config.model_warmup:
        return
    ctx = runtime.ctx
    samples = build_samples(config, ctx.model_path, ctx.check_file)
    originals = {t.name for t in config.input}
    for slot in runtime.slots:
        instance = slot.instance.ctx.name
        for name, runs, inputs in samples:
            for iteration in range(1, runs + 1):
                log.debug("model '%s' instance %s is running warmup sample '%s' for iteration %d", runtime.name,
                          instance, name, iteration)
                await _run_sample(runtime, slot, name, inputs, originals)


async def _run_sample(runtime, slot, name: str, inputs: list[dict], originals: set[str]) -> None:
    where = f"model '{runtime.name}': warmup sample '{name}'"
    loop = asyncio.get_running_loop()
    requests, finals = [], []
    for tensors in inputs:
        request = InferenceRequest(runtime.name, {k: v for k, v in tensors.items() if k in originals},
                                   model_version=str(runtime.version), id=f"warmup-{name}")
        try:
            runtime.validator.validate(request)
        except ServerError as exc:
            raise InvalidArgument(f"{where} does not fit the model configuration: {exc}") from None
        request.inputs.update({k: v for k, v in tensors.items() if k not in originals})
        done = loop.create_future()
        request.response_sender = ResponseSender(request, _Collector(loop, done))
        requests.append(request)
        finals.append(done)
    await runtime.execute(slot, requests, record=False)
    errors = [response.error for response in await asyncio.gather(*finals) if response.error is not None]
    if errors:
        log.debug("model '%s' instance %s failed to run warmup sample '%s'", runtime.name, slot.instance.ctx.name,
                  name)
        raise InvalidArgument(f"failed to run warmup sample '{name}': " + "".join(f"{e}; " for e in errors).rstrip())


class _Collector:
    """Resolves ``done`` with the final response (or the first error), from any thread."""

    __slots__ = ("loop", "done")

    def __init__(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        self.loop, self.done = loop, done

    def __call__(self, response: InferenceResponse) -> None:
        if response.final or response.error is not None:
            self.loop.call_soon_threadsafe(_resolve, self.done, response)


def _resolve(done: asyncio.Future, response: InferenceResponse) -> None:
    if not done.done():
        done.set_result(response)
