"""Repository behaviour in-process: versions, failures that stay local, control modes, polling."""

from __future__ import annotations

import pytest

from tideserve.errors import NotFound, ServerError, Unavailable
from tideserve.repository import ControlMode
from toy_backends import collect, sum_request, write_model


async def test_failed_model_is_unavailable_with_reason_and_others_serve(tmp_path, start_core):
    write_model(tmp_path, "good")
    write_model(tmp_path, "broken", params={"fail_load": "no weights"})
    (tmp_path / "badconfig" / "1").mkdir(parents=True)
    (tmp_path / "badconfig" / "config.pbtxt").write_text("max_batch_size: oops")
    write_model(tmp_path, "nobackend").joinpath("config.pbtxt").write_text('backend: "nonexistent"')
    dataplane = await start_core(tmp_path)
    index = {row["name"]: row for row in dataplane.repository_index()}
    assert index["good"]["state"] == "READY"
    assert index["broken"]["state"] == "UNAVAILABLE" and "no weights" in index["broken"]["reason"]
    assert "failed to parse" in index["badconfig"]["reason"]
    assert "unknown backend 'nonexistent'" in index["nobackend"]["reason"]
    assert not dataplane.ready()  # strict readiness, as Triton
    (response,) = await collect(dataplane, sum_request("good", 1))
    assert response.error is None
    with pytest.raises(Unavailable, match="no weights"):
        dataplane.infer(sum_request("broken", 1))
    with pytest.raises(NotFound):
        dataplane.infer(sum_request("missing", 1))


async def test_version_policy_and_version_lookup(tmp_path, start_core):
    write_model(tmp_path, "m", versions=(1, 2, 3), extra="version_policy: { latest: { num_versions: 2 } }")
    dataplane = await start_core(tmp_path)
    assert [r["version"] for r in dataplane.repository_index()] == ["2", "3"]
    assert dataplane.model_metadata("m")["versions"] == ["2", "3"]
    (response,) = await collect(dataplane, sum_request("m", 1))
    assert response.model_version == "3"
    (response,) = await collect(dataplane, sum_request("m", 1, model_version="2"))
    assert response.model_version == "2"
    with pytest.raises(NotFound, match="unknown version 1"):
        dataplane.infer(sum_request("m", 1, model_version="1"))


async def test_explicit_mode_load_unload_and_override(tmp_path, start_core):
    write_model(tmp_path, "a")
    write_model(tmp_path, "b")
    dataplane = await start_core(tmp_path, ControlMode.EXPLICIT, load=["a"])
    states = {r["name"]: r["state"] for r in dataplane.repository_index()}
    assert states == {"a": "READY", "b": ""}
    await dataplane.load_model("b", '{"backend": "toy", "max_batch_size": 2, '
                                    '"input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}, '
                                    '{"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}]}')
    assert dataplane.model_config("b").max_batch_size == 2
    with pytest.raises(ServerError, match="batch-size must be <= 2"):
        dataplane.infer(sum_request("b", 1, rows=3))
    await dataplane.unload_model("b")
    assert {r["name"]: r["state"] for r in dataplane.repository_index()}["b"] == "UNAVAILABLE"
    with pytest.raises(ServerError):
        dataplane.infer(sum_request("b", 1))
    with pytest.raises(ServerError, match="invalid model name"):
        await dataplane.load_model("../a")
    with pytest.raises(NotFound):
        await dataplane.load_model("nope")


async def test_explicit_star_loads_everything_and_none_mode_refuses_load(tmp_path, start_core):
    write_model(tmp_path, "a")
    write_model(tmp_path, "b")
    dataplane = await start_core(tmp_path, ControlMode.EXPLICIT, load=["*"])
    assert {r["state"] for r in dataplane.repository_index()} == {"READY"}
    dataplane = await start_core(tmp_path, ControlMode.NONE)
    with pytest.raises(Unavailable, match="not allowed if polling is enabled"):  # Triton's code and words
        await dataplane.load_model("a")


async def test_failed_reload_keeps_the_serving_version(tmp_path, start_core):
    model_dir = write_model(tmp_path, "m")
    dataplane = await start_core(tmp_path, ControlMode.EXPLICIT, load=["m"])
    (model_dir / "config.pbtxt").write_text("max_batch_size: broken")
    with pytest.raises(ServerError, match="failed to parse"):
        await dataplane.load_model("m")
    (response,) = await collect(dataplane, sum_request("m", 1))
    assert response.error is None


async def test_poll_picks_up_new_changed_and_removed_models(tmp_path, start_core):
    import shutil

    write_model(tmp_path, "a")
    dataplane = await start_core(tmp_path, ControlMode.POLL)
    write_model(tmp_path, "b")
    await dataplane.repository.poll()
    assert dataplane.model_ready("b")
    write_model(tmp_path, "a", max_batch_size=2)
    await dataplane.repository.poll()
    assert dataplane.model_config("a").max_batch_size == 2
    shutil.rmtree(tmp_path / "b")
    await dataplane.repository.poll()
    assert not dataplane.model_ready("b")
