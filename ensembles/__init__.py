"""Ensemble scheduling: pipelines whose steps are other models (``platform: "ensemble"``).

A step runs as soon as all its inputs exist, so independent steps run in parallel; tensors flow
along each step's ``input_map`` / ``output_map``. Each response of a decoupled step feeds the
steps downstream as it arrives, and the ensemble (decoupled when any step is) streams each result
to its client at once. See :mod:`ensembles.plan` for the load-time checks and the streams,
:mod:`ensembles.run` for one request, :mod:`ensembles.scheduler` for ``max_inflight_requests``.

Sequence parameters. A request made from a decoupled step's response carries the request
parameters ``sequence_id`` (int: the id of the upstream step request, unique in the server and so
per ensemble request), ``sequence_start`` (true on the request made from the upstream request's
first response) and ``sequence_end`` (true on the one made from its final response). When the
upstream ends with a bare FINAL flag instead, the downstream step still gets a ``sequence_end``
request if every input it would take from the stream is declared ``optional`` (those inputs are
left out); otherwise nothing is sent, and a stateful step must free the sequence on its own (it
sees ``is_cancelled()`` on a request in flight when the ensemble request is cancelled or fails,
and should keep its per-sequence state bounded). Python-backend models read these as
``request.correlation_id()`` and ``request.flags()`` (SEQUENCE_START / SEQUENCE_END).
"""

from .backend import EnsembleBackend, EnsembleModel

__all__ = ["EnsembleBackend", "EnsembleModel"]
