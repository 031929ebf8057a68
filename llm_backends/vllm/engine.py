"""Starting vLLM's in-process ``AsyncLLM`` and reading its scheduler state.

Imported only when a vLLM model loads (it imports vLLM, which takes seconds). :func:`start_engine`
blocks for as long as the engine takes to start (tens of seconds): call it on a worker thread. Built
outside a running loop, the engine starts its output handler lazily on the loop of its first request,
which is the server's.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from tideserve.backend_api import InvalidArgument, ServerError, Unavailable
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from .config import field_defaults
from .prometheus import ModelLabelled, prometheus_logger  # noqa: F401 (ModelLabelled: for the backend)

log = logging.getLogger(__name__)


@dataclass
class EngineState:
    """The scheduler's view after an engine step."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV-cache blocks in use, 0 to 1
    # when (time.monotonic(), one clock for every process of the host) the step's stats reached the client that
    # saw them; 0: unknown. The engine sends each step's stats to one of its clients (the core's, a worker's):
    # a state that reaches the core later than a newer one (a worker's, sent at most every STATE_EVERY_S) is old
    at: float = 0.0


class DeadlineProbe:
    """For measurements only (``TIDESERVE_DEADLINE_PROBE_FILE``: a path): what an admission flood costs the
    engine. Counts, since the server started: ``scheduled`` (requests the engine's scheduler admitted for the
    first time: their prefill started), ``steps`` (engine steps), ``started`` (requests whose first token the
    server saw before their deadline), ``placed`` (requests that reached their deadline with a place in the
    engine, ``generation.EngineOrder``: they ran on), ``expired`` (refused at the deadline), ``expired_rendering``
    (of those, refused before the engine had them: on arrival or while their prompt was still rendering) and
    ``expired_with_tokens`` (of those, ones whose first token then reached the server: the engine had run their
    prefill). Written to the
    file as JSON at most every 0.1 s: the engine's stat logger (on the server's loop) hands a copy of the counts to
    a thread of the probe's own, which writes it, so that the file system's time does not delay what the probe
    measures. Scheduled minus started is what the engine scheduled for requests it was then told to abort."""

    path = os.environ.get("TIDESERVE_DEADLINE_PROBE_FILE", "")
    counts = dict.fromkeys(("scheduled", "preempted", "steps", "started", "placed", "expired", "expired_rendering",
                            "expired_with_tokens"), 0)
    _written = 0.0
    _pending: dict | None = None  # the latest counts not yet written
    _wanted: threading.Event | None = None  # set when _pending holds counts (the writer thread waits on it)

    @classmethod
    def count(cls, key: str, n: int = 1) -> None:
        if cls.path:
            cls.counts[key] += n

    @classmethod
    def write(cls) -> None:
        now = time.monotonic()
        if now - cls._written >= 0.1:
            cls._written = now
            cls._pending = dict(cls.counts)
            if cls._wanted is None:
                cls._wanted = threading.Event()
                threading.Thread(target=cls._writer, name="deadline-probe", daemon=True).start()
            cls._wanted.set()

    @classmethod
    def _writer(cls) -> None:
        while True:
            cls._wanted.wait()
            cls._wanted.clear()
            counts, cls._pending = cls._pending, None
            if counts is None:
                continue
            tmp = f"{cls.path}.tmp"
            with open(tmp, "w") as out:
                json.dump(counts, out)
            os.replace(tmp, cls.path)


class _StateLogger(StatLoggerBase):
    """A vLLM stat logger that hands each step's scheduler stats to a callback (on the engine's loop)."""

    def __init__(self, on_state: Callable[[EngineState], None]) -> None:
        self._on_state = on_state

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        self._on_state(EngineState(
            running=scheduler_stats.num_running_reqs,
            waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
            kv_cache_usage=scheduler_stats.kv_cache_usage, at=time.monotonic()))
        if DeadlineProbe.path:
            DeadlineProbe.count("steps")
            if (cache := scheduler_stats.prefix_cache_stats) is not None:
                DeadlineProbe.count("scheduled", cache.requests)
                DeadlineProbe.count("preempted", cache.preempted_requests)
            DeadlineProbe.write()

    def log_engine_initialized(self) -> None:
        pass


# How a reader of vLLM's shared-memory message queue (worker, engine core) waits, set in the engine's processes by
# tideserve's vLLM plugin (llm_backends/vllm_plugin.py): it spins SHM_SPIN_MS after its last message (vLLM: 1000 ms),
# a worker SHM_WORKER_SPIN_MS, then sleeps, rechecking every SHM_RECHECK_MS (vLLM: 5000 ms); with SHM_QUIET_NOTIFY a
# writer leaves out its ZMQ wake-up while its reader still spins (a reader asleep anyway finds the message at its
# next recheck). An environment variable of the same name set before the server starts wins.
SHM_RECHECK_MS = "2"
SHM_SPIN_MS = "2"
SHM_WORKER_SPIN_MS = "3"
SHM_QUIET_NOTIFY = "1"


def _engine_environment() -> None:
    """What the engine's processes (spawned from this one) inherit: the settings tideserve's vLLM plugin applies.
    The short spins and the quiet notification only on a CPU platform, where the engine core's spin takes a core the
    worker, the server and its clients share; elsewhere the engine's processes keep vLLM's spin (a core of many, and
    no wake-up per step)."""
    from vllm.platforms import current_platform

    from tideserve.llm_backends.vllm_plugin import ENV, QUIET_ENV, SPIN_ENV, WORKER_SPIN_ENV

    os.environ.setdefault(ENV, SHM_RECHECK_MS)
    if current_platform.is_cpu():
        os.environ.setdefault(SPIN_ENV, SHM_SPIN_MS)
        os.environ.setdefault(WORKER_SPIN_ENV, SHM_WORKER_SPIN_MS)
        os.environ.setdefault(QUIET_ENV, SHM_QUIET_NOTIFY)


# "0": the model's worker runs in a process of its own, as vLLM's CPU platform sets it (its ``mp`` executor)
WORKER_IN_CORE_ENV = "TIDESERVE_VLLM_WORKER_IN_CORE"


def _worker_in_core(vllm_config, kwargs: dict[str, Any]) -> bool:
    """Whether the engine core process runs the model's worker itself (vLLM's ``uni`` executor), and if so set it.

    On a CPU platform vLLM turns a one-worker engine's ``uni`` executor into ``mp`` (the worker in a process of its
    own) because a worker's OpenMP threads are set through the environment its process starts with; every step then
    crosses a shared-memory queue twice (the scheduler's output pickled to the worker, the runner's output back), with
    the engine core spinning for the answer while the worker computes. The engine core process is spawned from this
    one, so it can start with the worker's OpenMP environment (:func:`_engine_core_threads`) and run the worker itself.
    Only for one worker (no tensor, pipeline or data parallelism), with the engine core in a process of its own, and
    where ``model.json`` names no executor."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if (os.environ.get(WORKER_IN_CORE_ENV, "1") == "0" or kwargs.get("distributed_executor_backend") is not None
            or not current_platform.is_cpu() or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "1"
            or parallel.world_size != 1 or parallel.data_parallel_size != 1
            or parallel.distributed_executor_backend != "mp"):
        return False
    parallel.distributed_executor_backend = "uni"
    return True


@contextmanager
def _engine_core_threads(vllm_config, in_core: bool):
    """While the engine core process is spawned: the OpenMP environment vLLM gives a CPU worker of rank 0 (thread
    count and binding, from ``VLLM_CPU_OMP_THREADS_BIND``), where the engine core runs the worker itself; where that
    worker has several cores, the cores its socket threads move to (vLLM's reserved ones, else all this process may
    use: ``vllm_plugin._engine_io_threads``)."""
    if not in_core:
        yield
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.utils.system_utils import set_env_var

    from tideserve.llm_backends.vllm_plugin import IO_CPUS_ENV

    manager = OMPProcessManager(vllm_config)
    io_cpus = ()  # the engine core's socket threads off the worker's cores where it has several (the plugin)
    if not manager.skip_setup and manager.cpu_lists and len(manager.cpu_lists[0]) > 1:
        io_cpus = manager.reserved_cpu_list or sorted(os.sched_getaffinity(0))
    with set_env_var(IO_CPUS_ENV, ",".join(map(str, io_cpus))), manager.configure_omp_envs(0, 0):
        if not io_cpus:  # (none for the spawn; set_env_var puts back what was there)
            os.environ.pop(IO_CPUS_ENV)
        yield


def engine_arg_defaults() -> dict[str, Any]:
    return field_defaults(AsyncEngineArgs)


def start_engine(kwargs: dict[str, Any], on_state: Callable[[EngineState], None],
                 registry: CollectorRegistry | None = None) -> AsyncLLM:
    """Build the engine (blocking); any failure is Unavailable with the engine's message.

    ``registry``: where vLLM's own Prometheus logger writes the model's ``vllm:*`` families (None: the
    engine's default, prometheus_client's process-wide registry; the backend always passes one)."""
    _engine_environment()
    loggers: list = [lambda _config, _index=0: _StateLogger(on_state)]
    if registry is not None:
        loggers.append(prometheus_logger(registry))
    try:
        if isinstance(kwargs.get("kv_events_config"), dict):  # model.json's object, as vLLM's --kv-events-config
            from vllm.config import KVEventsConfig

            kwargs = {**kwargs, "kv_events_config": KVEventsConfig(**kwargs["kv_events_config"])}
        args = AsyncEngineArgs(**kwargs)
        vllm_config = args.create_engine_config()
        from vllm.v1.executor import Executor

        with _engine_core_threads(vllm_config, _worker_in_core(vllm_config, kwargs)):
            return AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                            log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats,
                            stat_loggers=loggers)
    except ServerError:
        raise
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):  # an unknown key in model.json
            raise InvalidArgument(f"invalid vLLM engine arguments: {exc}") from None
        raise Unavailable(_failure(exc, kwargs)) from None
    except Exception as exc:
        log.debug("vLLM engine failed to start", exc_info=True)
        raise Unavailable(_failure(exc, kwargs)) from None


WORKER_READY_TIMEOUT_S = 20  # a worker's engine client waits this long for the engine's ready message


def start_engine_with_clients(kwargs: dict[str, Any], on_state: Callable[[EngineState], None],
                              registry: CollectorRegistry | None, workers: int) -> tuple[AsyncLLM, bytes | None]:
    """As :func:`start_engine`, with the engine core taking requests from ``workers`` more engine clients (vLLM's
    ``--api-server-count`` shape): this process's client is index 0, a frontend worker's index ``i`` (1..workers)
    connects at the addresses of entry ``i - 1`` of what the second value describes (a pickled dict: the engine's
    ``VllmConfig``, the worker clients' ``inputs`` and ``outputs`` addresses, the ``count`` of clients). An engine
    that cannot take them (data parallel) starts as usual and the second value is None: the workers relay."""
    import pickle

    _engine_environment()
    loggers: list = [lambda _config, _index=0: _StateLogger(on_state)]
    if registry is not None:
        loggers.append(prometheus_logger(registry))
    launch = None
    try:
        if isinstance(kwargs.get("kv_events_config"), dict):
            from vllm.config import KVEventsConfig

            kwargs = {**kwargs, "kv_events_config": KVEventsConfig(**kwargs["kv_events_config"])}
        args = AsyncEngineArgs(**kwargs)
        args._api_process_count = workers + 1
        args._api_process_rank = -1
        vllm_config = args.create_engine_config()
        if vllm_config.parallel_config.data_parallel_size > 1:
            log.info("data-parallel vLLM engine: frontend workers relay its requests through the core")
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=loggers), None
        from vllm.v1.engine.utils import (
            EngineZmqAddresses,
            bind_engine_zmq_listeners,
            get_engine_zmq_bind_addresses,
            launch_core_engines,
        )
        from vllm.v1.executor import Executor

        own = bind_engine_zmq_listeners(vllm_config, 1)  # this process's client: bound before the engine starts
        theirs = get_engine_zmq_bind_addresses(vllm_config, workers)  # the workers' clients bind these themselves
        addresses = EngineZmqAddresses(inputs=[own.inputs[0].address, *theirs.inputs],
                                       outputs=[own.outputs[0].address, *theirs.outputs])
        with _engine_core_threads(vllm_config, _worker_in_core(vllm_config, kwargs)), \
                launch_core_engines(vllm_config, Executor.get_class(vllm_config), not args.disable_log_stats,
                                    addresses) as launch:
            pass
        engine = AsyncLLM.from_vllm_config(
            vllm_config, stat_loggers=loggers, enable_log_requests=args.enable_log_requests,
            disable_log_stats=args.disable_log_stats,
            client_addresses={"input_address": own.inputs[0].address, "output_address": own.outputs[0].address,
                              "input_listener": own.inputs[0].socket, "output_listener": own.outputs[0].socket},
            client_count=workers + 1, client_index=0)
        # this client owns the engine's processes, as one that started them does: shut down with it, watched by it
        client = engine.engine_core
        client.resources.engine_manager = launch.engine_manager
        client.start_engine_core_monitor()
        launch = None
        blob = pickle.dumps({"config": vllm_config, "inputs": list(theirs.inputs), "outputs": list(theirs.outputs),
                             "count": workers + 1})
        return engine, blob
    except ServerError:
        raise
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise InvalidArgument(f"invalid vLLM engine arguments: {exc}") from None
        raise Unavailable(_failure(exc, kwargs)) from None
    except Exception as exc:
        log.debug("vLLM engine failed to start", exc_info=True)
        raise Unavailable(_failure(exc, kwargs)) from None
    finally:
        if launch is not None and launch.engine_manager is not None:
            launch.engine_manager.shutdown()


def _failure(exc: BaseException, kwargs: dict[str, Any]) -> str:
    message = f"vLLM engine failed to start: {type(exc).__name__}: {exc}"
    model = kwargs.get("model")
    if isinstance(model, str) and model.startswith("/") and not Path(model).exists():
        message += f" (the model path '{model}' does not exist)"
    return message


def unhealthy_cause(exc: BaseException) -> str:
    """Why the engine's ``check_health`` failed, in words for the model's reason."""
    if isinstance(exc, EngineDeadError):
        return "the vLLM engine core process died (its cause is in the server log)"
    return f"{type(exc).__name__}: {exc}"


def engine_processes(engine: AsyncLLM) -> list[int]:
    """The pids of the engine's processes: vLLM's engine core process(es) and everything they started (the
    workers); empty for an engine that runs in this process."""
    import psutil

    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    pids: list[int] = []
    for proc in getattr(manager, "processes", None) or ():
        if proc.pid is None:
            continue
        pids.append(proc.pid)
        try:
            pids.extend(child.pid for child in psutil.Process(proc.pid).children(recursive=True))
        except psutil.Error:
            pass
    return pids


def set_engine_nice(engine: AsyncLLM, nice: int) -> list[int]:
    """Run every thread of the engine's processes at ``nice`` (the config parameter ``engine_nice``); threads
    they start later inherit it. Returns the pids changed. A thread gone meanwhile is skipped; a refusal by the
    OS (lowering a nice value needs a privilege) is logged, not raised: the engine runs on either way."""
    changed: list[int] = []
    for pid in engine_processes(engine):
        try:
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            threads = [pid]
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: a thread's own nice value
            except ProcessLookupError:
                continue
            except OSError as exc:
                log.warning("engine process %d thread %d: could not set nice %d: %s", pid, tid, nice, exc)
                return changed
        changed.append(pid)
    return changed


# How long the engine's processes get to end on their own before vLLM kills them. By then the model is drained
# (nothing runs on the engine): they only tidy up, and on a CPU the engine core waits for its worker longer than
# vLLM's default grace (5 s), so every stop took the whole grace and ended in a kill anyway.
ENGINE_STOP_GRACE_S = 2.0
# How long :func:`stop_engine` waits for the processes it kills to be gone.
ENGINE_KILL_WAIT_S = 5.0


def stop_engine(engine: AsyncLLM) -> None:
    """Shut the engine's processes down (blocking) and return once none of them runs.

    vLLM's engine core gets ``ENGINE_STOP_GRACE_S`` to end; past it vLLM kills the engine core and its workers. An
    engine core that ends within the grace (one that got the signal itself, as a terminal's Ctrl-C or a group's
    SIGTERM sends it) may leave its worker behind: a vLLM CPU worker's own exit runs torch's teardown of its
    operator registrations, seconds of one CPU, after this server is gone and into whatever the machine runs next.
    Whatever of the engine's processes (found before the shutdown) still runs after it is killed, as vLLM kills
    what a late engine core leaves: the model is drained, nothing is left to tidy."""
    processes = _processes(engine_processes(engine))
    engine.shutdown(timeout=ENGINE_STOP_GRACE_S)
    end_processes(processes)


def _processes(pids: list[int]) -> list:
    import psutil

    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))  # (its start time: a pid reused later is not this process)
        except psutil.Error:
            pass
    return found


def end_processes(processes: list, wait_s: float = ENGINE_KILL_WAIT_S) -> list:
    """SIGKILL each of ``processes`` (psutil.Process) that still runs and wait up to ``wait_s`` for them to be gone
    (a zombie counts as gone: its parent reaps it). Returns those killed."""
    import psutil

    killed = [proc for proc in processes if process_running(proc)]
    for proc in killed:
        log.info("the vLLM engine's process %d (%s) outlived the engine's shutdown: killing it", proc.pid,
                 _name(proc))
        try:
            proc.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + wait_s
    while any(process_running(proc) for proc in killed) and time.monotonic() < deadline:
        time.sleep(0.02)
    return killed


def process_running(proc) -> bool:
    """Whether ``proc`` (a psutil.Process) still runs: a zombie, waiting for its parent to reap it, does not."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc) -> str:
    try:
        return proc.name()
    except Exception:  # noqa: BLE001 - a name for the log only
        return "?"
