"""auto_complete: a model whose configuration comes from auto_complete_config."""

import json

import helpers
import numpy as np

import triton_python_backend_utils as pb_utils

from . import helpers as relative_helpers


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        have = {t["name"] for t in config["input"]} | {t["name"] for t in config["output"]}
        for tensor in ({"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [-1]},):
            if tensor["name"] not in have:
                auto_complete_model_config.add_input(tensor)
        for tensor in ({"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [-1]},
                       {"name": "ARGS", "data_type": "TYPE_STRING", "dims": [1]}):
            if tensor["name"] not in have:
                auto_complete_model_config.add_output(tensor)
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def initialize(self, args):
        if helpers.NAME != "auto_complete" or relative_helpers.NAME != "auto_complete":
            raise pb_utils.TritonModelException("imported another model's helpers module")
        self.args = dict(args)
        self.args["model_dir"] = pb_utils.get_model_dir()
        pb_utils.Logger.log_info(f"auto_complete initialized as {args['model_instance_name']}")

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            args = json.dumps(self.args).encode()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (data * helpers.SCALE).astype(np.int32)),
                pb_utils.Tensor("ARGS", np.array([[args]] * data.shape[0], dtype=np.object_)),
            ]))
        return responses
