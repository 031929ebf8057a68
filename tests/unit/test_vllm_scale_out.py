"""Engine scale-out: vLLM's parallelism arguments in ``model.json`` (or config parameters) reach the engine
unchanged: tensor, pipeline and data parallel sizes and the distributed executor backend (``mp`` / ``ray``).

Without an engine: the keyword arguments the vllm backend builds, then vLLM's own ``AsyncEngineArgs`` and the
engine configuration it resolves (a CPU machine resolves a 2 x 2 layout without starting workers)."""

from __future__ import annotations

import json
import os

from support import REPO

from tideserve import config as config_module
from tideserve.backend import ModelContext
from tideserve.llm_backends.vllm import config as vllm_config


PARALLEL = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 1,
            "distributed_executor_backend": "mp"}
TINY_LLAMA = REPO / "model_repository" / "llm" / "1" / "tiny_llama"
DEFAULTS = {"model": None, "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
            "distributed_executor_backend": None}


def _tiny_model(tmp_path):
    """The example's tiny Llama, or one made here where the example's preparation (make serve) has not run."""
    if (TINY_LLAMA / "config.json").is_file():
        return TINY_LLAMA
    from tideserve.bench.examples.tiny_llama import make_model

    return make_model(tmp_path / "tiny_llama")


def _one_worker_config(model):
    """vLLM's engine configuration of one worker for ``model`` (resolved on this CPU machine, nothing started)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(model=str(model), dtype="float32", max_model_len=256,
                           enforce_eager=True).create_engine_config()


def _context(tmp_path, engine_args: dict, parameters: dict | None = None, allowed=()) -> ModelContext:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.json").write_text(json.dumps(engine_args))
    config = config_module.normalize(config_module.parse_text('name: "llm"\nbackend: "vllm"'), "llm", tmp_path)
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = value
    return ModelContext("llm", 1, config, tmp_path, allowed_roots=tuple(allowed))


def test_parallel_arguments_pass_through_unchanged(tmp_path):
    kwargs = vllm_config.engine_kwargs(_context(tmp_path, {"model": "org/name", **PARALLEL}), DEFAULTS)
    assert kwargs == {"model": "org/name", **PARALLEL}


def test_config_parameters_set_parallel_arguments_with_their_types(tmp_path):
    ctx = _context(tmp_path, {"model": "org/name"},
                   {"tensor_parallel_size": "4", "data_parallel_size": "2", "distributed_executor_backend": "ray"})
    kwargs = vllm_config.engine_kwargs(ctx, DEFAULTS)
    assert kwargs == {"model": "org/name", "tensor_parallel_size": 4, "data_parallel_size": 2,
                      "distributed_executor_backend": "ray"}


def test_vllm_engine_args_and_config_carry_the_layout(tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs

    from tideserve.llm_backends.vllm.engine import engine_arg_defaults

    model = _tiny_model(tmp_path)
    engine_args = {"model": str(model), "dtype": "float32", "max_model_len": 256, "enforce_eager": True,
                   **PARALLEL}
    kwargs = vllm_config.engine_kwargs(_context(tmp_path, engine_args, allowed=[model]), engine_arg_defaults())
    args = AsyncEngineArgs(**kwargs)  # what engine.start_engine builds the engine from
    assert {key: getattr(args, key) for key in PARALLEL} == PARALLEL
    parallel = args.create_engine_config().parallel_config
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.data_parallel_size,
            parallel.distributed_executor_backend, parallel.world_size) == (2, 2, 1, "mp", 4)


def _resolved(tmp_path, monkeypatch, extra: dict, env: str | None = None):
    """The engine configuration one worker's engine resolves to on this CPU machine, and whether the engine core
    then runs the worker itself (no engine started)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from tideserve.llm_backends.vllm import engine as vllm_engine

    if env is None:
        monkeypatch.delenv(vllm_engine.WORKER_IN_CORE_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_engine.WORKER_IN_CORE_ENV, env)
    model = _tiny_model(tmp_path)
    kwargs = {"model": str(model), "dtype": "float32", "max_model_len": 256, "enforce_eager": True, **extra}
    config = AsyncEngineArgs(**kwargs).create_engine_config()
    assert config.parallel_config.distributed_executor_backend == "mp"  # what vLLM's CPU platform sets
    in_core = vllm_engine._worker_in_core(config, kwargs)
    return in_core, config.parallel_config.distributed_executor_backend


def test_one_worker_runs_in_the_engine_core_process_on_a_cpu(tmp_path, monkeypatch):
    assert _resolved(tmp_path, monkeypatch, {}) == (True, "uni")


def test_the_worker_keeps_its_own_process_where_asked_or_parallel(tmp_path, monkeypatch):
    assert _resolved(tmp_path, monkeypatch, {}, env="0") == (False, "mp")
    assert _resolved(tmp_path, monkeypatch, {"distributed_executor_backend": "mp"}) == (False, "mp")
    assert _resolved(tmp_path, monkeypatch, {"tensor_parallel_size": 2}) == (False, "mp")


def test_the_engine_core_starts_with_the_workers_openmp_environment(tmp_path, monkeypatch):
    """While the engine core process is spawned it gets the OpenMP thread count vLLM would give the worker's
    process; after, this process's environment is as it was."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    from tideserve.llm_backends.vllm import engine as vllm_engine

    model = _tiny_model(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = _one_worker_config(model)
    manager = OMPProcessManager(config)
    with vllm_engine._engine_core_threads(config, True):
        threads = os.environ.get("OMP_NUM_THREADS")
    if manager.skip_setup:  # VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM sets nothing for its worker either
        assert threads is None
    else:
        assert threads == str(len(manager.cpu_lists[0]))
    assert "OMP_NUM_THREADS" not in os.environ
    with vllm_engine._engine_core_threads(config, False):
        assert "OMP_NUM_THREADS" not in os.environ


def test_a_worker_of_several_cores_leaves_the_engine_core_s_socket_threads_off_its_cores(tmp_path, monkeypatch):
    """VLLM_CPU_OMP_THREADS_BIND giving the worker two cores: while the engine core is spawned it is told where its
    socket threads run (every core here: none reserved), and vLLM's plugin hook moves them there."""
    import vllm.envs
    from vllm.v1.engine import core

    from tideserve.llm_backends import vllm_plugin
    from tideserve.llm_backends.vllm import engine as vllm_engine

    model = _tiny_model(tmp_path)

    def bind(value: str) -> None:  # (vLLM may have cached its environment by now: its module attribute wins)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
        monkeypatch.setattr(vllm.envs, "VLLM_CPU_OMP_THREADS_BIND", value, raising=False)

    bind("0-1")
    monkeypatch.delenv(vllm_plugin.IO_CPUS_ENV, raising=False)
    config = _one_worker_config(model)
    with vllm_engine._engine_core_threads(config, True):
        assert os.environ.get("OMP_NUM_THREADS") == "2"
        cpus = os.environ.get(vllm_plugin.IO_CPUS_ENV)
        assert cpus == ",".join(map(str, sorted(os.sched_getaffinity(0))))
        # what the engine core process does with it (vLLM runs the plugin there)
        for name in ("process_input_sockets", "process_output_sockets"):
            monkeypatch.setattr(core.EngineCoreProc, name, getattr(core.EngineCoreProc, name))
        vllm_plugin._engine_io_threads()
        assert all(getattr(getattr(core.EngineCoreProc, name), "tideserve", False)
                   for name in ("process_input_sockets", "process_output_sockets"))
    assert vllm_plugin.IO_CPUS_ENV not in os.environ
    bind("0")  # one core: the socket threads stay where they start
    config = _one_worker_config(model)
    with vllm_engine._engine_core_threads(config, True):
        assert vllm_plugin.IO_CPUS_ENV not in os.environ
