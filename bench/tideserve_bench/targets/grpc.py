"""gRPC ``ModelStreamInfer`` (``tritonclient.grpc.aio``): one bidirectional stream per request.

The request carries Triton's vLLM inputs (``text_input``, ``stream`` = true, ``sampling_parameters``
JSON and the ``return_*`` flags); responses arrive until one has ``triton_final_response`` set. The
request side of the stream stays open until then (half-closing early is legal, but some servers end
the call on it). All streams share one channel (HTTP/2 multiplexing).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np

from ..records import RequestInput, RequestRecord
from .base import Target, short
from .kserve import ResponseReader, sampling_parameters

FINAL = "triton_final_response"
OUTPUTS = ("text_output", "num_output_tokens", "num_input_tokens", "finish_reason")


class GrpcStreamTarget(Target):
    name = "grpc-stream"
    streams_usage = True

    def __init__(self, options) -> None:
        super().__init__(options)
        self.client = None
        url = options.url
        for scheme in ("grpc://", "http://", "https://"):
            url = url.removeprefix(scheme)
        self.address = url.rstrip("/")

    async def open(self) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(self.address)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "address": self.address}

    def inputs(self, request: RequestInput) -> list:
        import tritonclient.grpc as grpcclient

        tensors = []

        def add(name: str, datatype: str, array: np.ndarray) -> None:
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)

        add("text_input", "BYTES", np.array([request.prompt.encode()], dtype=np.object_))
        add("stream", "BOOL", np.array([True]))
        sampling = json.dumps(sampling_parameters(request, self.options))
        add("sampling_parameters", "BYTES", np.array([sampling.encode()], dtype=np.object_))
        if self.options.server_counts:
            for flag in ("return_num_input_tokens", "return_num_output_tokens", "return_finish_reason"):
                add(flag, "BOOL", np.array([True]))
        return tensors

    async def _send(self, request: RequestInput, record: RequestRecord) -> None:
        assert self.client is not None, "open() the target first"
        inputs = self.inputs(request)
        done = asyncio.Event()
        message = {"model_name": self.options.model, "model_version": self.options.model_version,
                   "inputs": inputs, "request_id": record.request_id}

        async def requests():
            yield message
            await done.wait()

        reader = ResponseReader(record)
        record.start = time.perf_counter()
        responses = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                now = time.perf_counter()
                if error is not None:
                    record.fail("server error: " + short(error.message() if hasattr(error, "message") else error))
                    return
                response = result.get_response()
                fields = {}
                for name in OUTPUTS:
                    array = result.as_numpy(name)
                    if array is not None:
                        fields[name] = array.reshape(-1).tolist()
                reader.add(fields, now)
                if FINAL in response.parameters and response.parameters[FINAL].bool_param:
                    record.ended = True
                    finished = True
                    break
        finally:
            done.set()
            if not finished:
                responses.cancel()
        if finished:
            # let the call end cleanly (the request side closes now); nothing more is expected
            async for _ in responses:
                pass
