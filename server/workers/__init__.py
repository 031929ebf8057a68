"""Frontend worker processes: HTTP and gRPC served by N processes over one core (``--frontend-workers``).

The core process keeps the repository, the DataPlane, the schedulers and the models; each worker runs
the same frontends as a single-process server over a :class:`~.remote.RemoteDataPlane`, which sends
inference and calls to the core over a Unix socket (:mod:`.protocol`) and answers the frontends'
questions about the repository from a copy the core pushes on every change (:mod:`.pool`).
"""
