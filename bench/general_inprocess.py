"""In-process baselines for bench/general_models.py, run as a subprocess of it (a process of its own,
so it gets the same cores a server gets and no state is shared with the benchmark driver).

    python bench/general_inprocess.py fil MODEL_FILE MODEL_TYPE ROWS.npy --nthread N [--parallel P]
                                          [--seconds 3 --windows 3]
    python bench/general_inprocess.py ort MODEL.onnx INPUTS.npz --batch 1 32 --intra-op N [--spinning 0|1]

Each prints one JSON object on stdout. ``fil`` calls the very library function tideserve's FIL backend
predicts with (``xgboost.Booster.inplace_predict`` for XGBoost JSON/UBJSON, ``treelite.gtil.predict``
for Treelite checkpoints) on the same rows, in a loop (from ``parallel`` threads at once, like a model's
instances sharing one loaded model), ``windows`` times ``seconds`` seconds, and reports calls/s and rows/s
of each window. ``ort`` runs an ONNX Runtime session as the onnxruntime backend opens
it (thread counts, spinning) at each batch size and reports sequences/s.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np


def _windows(call, seconds: float, windows: int, parallel: int = 1, cpu: list | None = None) -> list[float]:
    """Calls per second in each of ``windows`` windows of about ``seconds``, from ``parallel`` threads
    calling at once (the libraries release the GIL while they predict); ``cpu`` gets the process's CPU
    milliseconds per call in each window."""
    for _ in range(20):  # warm-up
        call()
    rates = []
    for _ in range(windows):
        counts = [0] * parallel
        start = time.perf_counter()

        def loop(i: int, counts: list[int] = counts, start: float = start) -> None:
            while time.perf_counter() - start < seconds:
                call()
                counts[i] += 1

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(parallel)]
        cpu_start = time.process_time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates.append(sum(counts) / (time.perf_counter() - start))
        if cpu is not None:
            cpu.append((time.process_time() - cpu_start) / max(sum(counts), 1) * 1000)
    return rates


def fil(args) -> dict:
    rows = np.ascontiguousarray(np.load(args.rows), dtype=np.float32)
    path = Path(args.model_file)
    if args.model_type.startswith("xgboost"):
        import xgboost

        booster = xgboost.Booster(model_file=bytearray(path.read_bytes()))
        booster.set_param({"nthread": args.nthread})

        def call():
            return booster.inplace_predict(rows, validate_features=False)

        library = f"xgboost {xgboost.__version__} Booster.inplace_predict"
    else:
        import treelite
        from treelite import gtil

        model = treelite.Model.deserialize(str(path))

        def call():
            return gtil.predict(model, rows, nthread=args.nthread)

        library = f"treelite {treelite.__version__} gtil.predict"
    cpu: list[float] = []
    rates = _windows(call, args.seconds, args.windows, args.parallel, cpu)
    return {"library": library, "nthread": args.nthread, "parallel": args.parallel, "rows": len(rows),
            "calls_per_s": rates, "cpu_ms_per_call": cpu,
            "rows_per_s": [r * len(rows) for r in rates]}


def ort(args) -> dict:
    import onnxruntime

    feeds = dict(np.load(args.inputs))
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = args.intra_op
    options.inter_op_num_threads = args.intra_op
    if args.spinning is not None:
        options.add_session_config_entry("session.intra_op.allow_spinning", args.spinning)
    session = onnxruntime.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
    out = {"onnxruntime": onnxruntime.__version__, "intra_op": args.intra_op, "spinning": args.spinning,
           "sequence_length": int(next(iter(feeds.values())).shape[1]), "batches": {}}
    for batch in args.batch:
        batch_feeds = {k: np.ascontiguousarray(np.resize(v, (batch, v.shape[1]))) for k, v in feeds.items()}
        cpu: list[float] = []
        rates = _windows(lambda feeds=batch_feeds: session.run(None, feeds), args.seconds, args.windows, cpu=cpu)
        out["batches"][str(batch)] = {"calls_per_s": rates, "seq_per_s": [r * batch for r in rates],
                                      "cpu_ms_per_seq": [c / batch for c in cpu]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fil")
    p.add_argument("model_file")
    p.add_argument("model_type")
    p.add_argument("rows")
    p.add_argument("--nthread", type=int, required=True)
    p.add_argument("--parallel", type=int, default=1, help="threads predicting at once (the model's instances)")
    p = sub.add_parser("ort")
    p.add_argument("model")
    p.add_argument("inputs")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--intra-op", type=int, required=True)
    p.add_argument("--spinning", choices=["0", "1"])
    for p in sub.choices.values():
        p.add_argument("--seconds", type=float, default=3.0)
        p.add_argument("--windows", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(fil(args) if args.command == "fil" else ort(args)))


if __name__ == "__main__":
    main()
