"""What the vLLM backend reads of a KServe request's tensors and parameters (no engine)."""

from __future__ import annotations


def test_vllm_backend_reads_add_special_tokens_and_text_for_token_prompts():
    import numpy as np

    from tideserve.llm_backends.vllm.inputs import parse_inputs
    from tideserve.types import InferenceRequest, RequestedOutput, Tensor

    ids = Tensor.from_numpy("input_ids", np.array([1, 2, 3], np.int32))
    request = InferenceRequest("llm", {"input_ids": ids}, parameters={"add_special_tokens": False, "n": 2},
                               outputs=[RequestedOutput("text_output")])
    parsed = parse_inputs(request)
    assert parsed.outputs == {"text_output"} and not parsed.add_special_tokens and parsed.sampling == {"n": 2}
    parsed = parse_inputs(InferenceRequest("llm", {"input_ids": ids}))
    assert parsed.outputs == {"output_ids"} and parsed.add_special_tokens  # Triton's token interface as before
