"""MiniLM's tokenizer as a Triton Python model: ``text`` (BYTES [batch, 1]) -> ``input_ids`` and
``attention_mask`` (INT64 [batch, length]), padded to the longest sentence of the request (rounded up
to a multiple of the ``pad_to_multiple_of`` parameter, when set: the encoder's batcher batches requests
of one shape; the mask keeps the padding out of the embedding) and truncated at the ``max_length``
parameter, as sentence-transformers tokenizes for this model. A request
whose text is not UTF-8 is answered with an INVALID_ARG error (HTTP 400, gRPC INVALID_ARGUMENT)."""

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = Path(args["model_repository"]) / args["model_version"] / "tokenizer.json"
        if not path.is_file():
            raise pb_utils.TritonModelException(
                f"{path} is missing: run `python -m tideserve.bench.examples.prepare` (make serve does) first")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.enable_truncation(int(parameters.get("max_length", "256")))
        multiple = int(parameters.get("pad_to_multiple_of", "0")) or None
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", pad_to_multiple_of=multiple)

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
            try:
                sentences = [_text(t, i) for i, t in enumerate(texts)]
            except ValueError as exc:  # this request's answer; the batch's others still run
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
                continue
            encodings = self.tokenizer.encode_batch(sentences)
            ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(len(texts), -1)
            mask = np.array([e.attention_mask for e in encodings], dtype=np.int64).reshape(len(texts), -1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)]))
        return responses


def _text(value, index: int) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"input 'text' element {index} is not valid UTF-8: {exc.reason} at byte {exc.start}") \
            from None
