"""MLServer's stock XGBoost and scikit-learn runtimes, with one change: responses carry no output
``parameters``. Copied into each MLServer model folder by bench/general_models.py (implementation
``general_mlserver_models.XGBoost`` / ``.SKLearn``); it runs inside MLServer's own venv.

Why: the stock runtimes encode outputs with NumpyCodec, which sets ``parameters: {content_type: np}``,
and Triton's HTTP client (so perf_analyzer over HTTP) rejects output parameters that lack
``binary_data_size``. Loading, decoding and predicting are the stock code, untouched.
"""

from mlserver.types import InferenceRequest, InferenceResponse
from mlserver_sklearn import SKLearnModel
from mlserver_xgboost import XGBoostModel


def _strip(response: InferenceResponse) -> InferenceResponse:
    for output in response.outputs:
        output.parameters = None
    return response


class XGBoost(XGBoostModel):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        return _strip(await super().predict(payload))


class SKLearn(SKLearnModel):
    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        return _strip(await super().predict(payload))
