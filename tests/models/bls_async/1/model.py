"""bls_async: async execute with concurrent BLS calls (async_exec), one of them to a decoupled model."""

import asyncio

import numpy as np

import triton_python_backend_utils as pb_utils


async def repeat_total(values):
    request = pb_utils.InferenceRequest(model_name="repeat", inputs=[pb_utils.Tensor("IN", values)],
                                        requested_output_names=["OUT"])
    total = count = 0
    async for response in await request.async_exec(decoupled=True):
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        out = pb_utils.get_output_tensor_by_name(response, "OUT")
        if out is not None:  # the last response may only mark the end of the stream
            total += int(out.as_numpy()[0])
            count += 1
    return total, count


class TritonPythonModel:
    async def execute(self, requests):
        return await asyncio.gather(*(self.answer(r) for r in requests))

    async def answer(self, request):
        bls_request = pb_utils.InferenceRequest(
            model_name="add_sub",
            inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                    pb_utils.get_input_tensor_by_name(request, "INPUT1")],
            requested_output_names=["OUTPUT0", "OUTPUT1"])
        calls = [bls_request.async_exec()]
        repeat_in = pb_utils.get_input_tensor_by_name(request, "REPEAT_IN")
        if repeat_in is not None:
            calls.append(repeat_total(repeat_in.as_numpy()))
        results = await asyncio.gather(*calls)
        add_sub = results[0]
        if add_sub.has_error():
            return pb_utils.InferenceResponse(error=add_sub.error())
        outputs = [pb_utils.get_output_tensor_by_name(add_sub, "OUTPUT0"),
                   pb_utils.get_output_tensor_by_name(add_sub, "OUTPUT1")]
        if repeat_in is not None:
            total, count = results[1]
            outputs += [pb_utils.Tensor("REPEAT_SUM", np.array([total], np.int32)),
                        pb_utils.Tensor("REPEAT_COUNT", np.array([count], np.int32))]
        return pb_utils.InferenceResponse(output_tensors=outputs)
