"""bench/http_servers.py's KServe v2 HTTP servicer without a server: tritonclient's own request bodies (JSON and
binary tensors) in, its parser on the answers, and the statistics perf_analyzer reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from tideserve.bench.http_servers import Servicer

HEADER = "Inference-Header-Content-Length"


def _request(binary: bool):
    a, b = np.arange(4, dtype=np.float32), np.full(4, 2, dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    body, header_length = httpclient.InferenceServerClient.generate_request_body(inputs, outputs, request_id="7")
    return a, b, body, header_length


@pytest.mark.parametrize("binary", [False, True])
def test_infer_answers_tritonclient(binary):
    s = Servicer()
    a, b, body, header_length = _request(binary)
    status, headers, out = s.handle("POST", "/v2/models/add_sub/infer",
                                    None if header_length is None else str(header_length), body)
    assert status == 200
    length = dict(headers).get(HEADER.lower().encode())
    result = httpclient.InferenceServerClient.parse_response_body(
        out, header_length=None if length is None else int(length))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.get_response()["id"] == "7"
    assert (length is not None) is binary


def test_statistics_count_infer_requests_and_queue():
    s = Servicer()
    _, _, body, header_length = _request(False)
    for _ in range(3):
        s.handle("POST", "/v2/models/add_sub/versions/1/infer", header_length, body)
    status, _, out = s.handle("GET", "/v2/models/add_sub/stats", None, b"")
    stats = json.loads(out)["model_stats"][0]
    assert status == 200 and stats["inference_count"] == 3
    # perf_analyzer takes the version whose queue count grew, and needs the compute counts equal
    inference = stats["inference_stats"]
    assert inference["queue"]["count"] == inference["compute_infer"]["count"] == inference["success"]["count"] == 3


def test_errors_are_kserve_shaped():
    s = Servicer()
    status, _, out = s.handle("POST", "/v2/models/add_sub/infer", None, b"{not json")
    assert status == 400 and "error" in json.loads(out)
    status, _, out = s.handle("GET", "/v2/models/other", None, b"")
    assert status == 404 and "error" in json.loads(out)
    for path in ("/v2/health/ready", "/v2/models/add_sub/ready"):
        assert s.handle("GET", path, None, b"")[0] == 200
    config = json.loads(s.handle("GET", "/v2/models/add_sub/config", None, b"")[2])
    assert config["max_batch_size"] == 0 and [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
