"""The ``tokenizer`` backend: a Hugging Face tokenizer as a preprocess or postprocess model.

Each instance loads its own tokenizer (``AutoTokenizer``, offline) on its worker thread and answers
each request of a batch on its own (an error answers that request only). A postprocess model's
streaming state lives in one :class:`SequenceTable` shared by its instances; with more than one
instance the :class:`SequenceRouter` runs every piece of a sequence on the same instance, in order.

Postprocess instances decode small batches (a streamed engine step: a few token ids per request) on the
event loop, where that takes microseconds, instead of handing every piece to the instance's thread and
back; a batch with more than ``INLINE_MAX_IDS`` token ids in all (whole texts) still runs on the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tideserve.backend_api import (
    Backend,
    DirectScheduler,
    DynamicBatcher,
    InferenceRequest,
    InferenceResponse,
    Model,
    ModelContext,
    ModelInstance,
    Scheduler,
    ServerError,
    Unavailable,
    as_server_error,
)

from . import config as tokenizer_config
from .config import Mode, Settings
from .detokenizer import SequenceTable
from .postprocess import Postprocessor
from .preprocess import Preprocessor
from .routing import SequenceRouter
from .tensors import OutputBuilder

if TYPE_CHECKING:
    from tideserve.backend_api import ModelRuntime

log = logging.getLogger(__name__)


_IMPORT_LOCK = threading.Lock()


def _auto_tokenizer():
    """``transformers.AutoTokenizer``. Importing it from two threads at once fails in one of them ("cannot
    import name 'AutoTokenizer'": transformers' lazy module is not thread-safe), as when a preprocess and a
    postprocess model load in parallel: instances take turns, and a race with another importer is retried."""
    with _IMPORT_LOCK:
        for attempt in range(5):
            try:
                from transformers import AutoTokenizer

                return AutoTokenizer
            except ImportError:
                if attempt == 4:
                    raise
                time.sleep(0.2)


def load_tokenizer(settings: Settings, model_name: str):
    """``AutoTokenizer`` from the settings' directory, without touching the network."""
    AutoTokenizer = _auto_tokenizer()

    try:
        return AutoTokenizer.from_pretrained(str(settings.tokenizer_dir), local_files_only=True,
                                             trust_remote_code=settings.trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a directory it cannot read
        raise Unavailable(f"model '{model_name}': cannot load a tokenizer from {settings.tokenizer_dir}: "
                          f"{type(exc).__name__}: {exc}") from exc


class TokenizerInstance(ModelInstance):
    model: TokenizerModel
    processor: Preprocessor | Postprocessor

    def initialize(self) -> None:
        model = self.model
        tokenizer = load_tokenizer(model.settings, model.ctx.name)
        outputs = OutputBuilder(model.config)
        batched = model.config.max_batch_size > 0
        if model.settings.mode is Mode.PREPROCESS:
            self.processor = Preprocessor(tokenizer, model.settings, outputs, batched)
        else:
            self.processor = Postprocessor(tokenizer, model.settings, model.sequences, outputs, batched)

    def execute(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        return [self._respond(request) for request in requests]

    def _respond(self, request: InferenceRequest) -> InferenceResponse:
        try:
            return self.processor.respond(request)
        except ServerError as exc:
            return InferenceResponse(error=exc)
        except Exception as exc:  # a tokenizer error answers this request; the batch's others still run
            log.warning("model '%s': request failed", self.model.ctx.name, exc_info=True)
            return InferenceResponse(error=as_server_error(exc))


# A postprocess batch with at most this many token ids is decoded on the event loop (tens of microseconds).
INLINE_MAX_IDS = 512


def _id_count(request: InferenceRequest) -> int:
    tensor = request.inputs.get("output_ids")
    return 0 if tensor is None else int(tensor.data.size)


class PostprocessInstance(TokenizerInstance):
    """A postprocess instance: small batches inline on the loop, large ones on the instance's thread."""

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{ctx.name}-decode")

    async def execute(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        if sum(_id_count(r) for r in requests) <= INLINE_MAX_IDS:
            return [self._respond(request) for request in requests]
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: [self._respond(request) for request in requests])

    def finalize(self) -> None:
        self._executor.shutdown(wait=False)


class TokenizerModel(Model):
    instance_class = TokenizerInstance

    def __init__(self, backend: Backend, ctx: ModelContext) -> None:
        super().__init__(backend, ctx)
        self.settings = Settings.from_context(ctx)
        if self.settings.mode is Mode.POSTPROCESS:
            self.instance_class = PostprocessInstance
        self.sequences = SequenceTable(self.settings.max_sequences, self.settings.sequence_idle_timeout_s)

    def auto_complete_config(self) -> None:
        tokenizer_config.auto_complete(self.config, self.settings.mode)

    def create_scheduler(self, runtime: ModelRuntime) -> Scheduler:
        if self.settings.mode is Mode.POSTPROCESS and len(runtime.slots) > 1:
            return SequenceRouter(runtime)
        if self.config.HasField("dynamic_batching"):
            return DynamicBatcher(runtime)
        return DirectScheduler(runtime)


class TokenizerBackend(Backend):
    name = "tokenizer"
    model_class = TokenizerModel
