"""tideserve-bench's workloads without a server: length distributions, Poisson arrivals, synthetic prompts
of the asked token counts, JSONL workloads."""

from __future__ import annotations

import numpy as np
import pytest

from tideserve.bench.tideserve_bench.workload import (
    JsonlWorkload,
    LengthDist,
    SyntheticWorkload,
    Tokenizer,
    arrival_offsets,
    poisson_arrivals,
    save_workload,
)


# -- workloads ------------------------------------------------------------------------------------
def test_length_distributions_parse_and_sample_seeded():
    assert LengthDist.parse("128") == LengthDist.parse("fixed:128") == LengthDist("fixed", 128)
    rng = np.random.default_rng(0)
    assert {LengthDist.parse("7").sample(rng) for _ in range(20)} == {7}

    uniform = LengthDist.parse("uniform:10,20")
    values = [uniform.sample(np.random.default_rng([1, i])) for i in range(4000)]
    assert min(values) == 10 and max(values) == 20             # both ends included
    assert np.mean(values) == pytest.approx(15, abs=0.3)
    assert values == [uniform.sample(np.random.default_rng([1, i])) for i in range(4000)]   # seeded

    normal = LengthDist.parse("normal:100,10")
    values = np.array([normal.sample(np.random.default_rng([2, i])) for i in range(4000)])
    assert values.mean() == pytest.approx(100, abs=1) and values.std() == pytest.approx(10, rel=0.08)
    clipped = LengthDist.parse("normal:100,50,90,110")
    values = [clipped.sample(np.random.default_rng([3, i])) for i in range(1000)]
    assert min(values) == 90 and max(values) == 110
    assert clipped.describe() == "normal:100,50,90,110" and uniform.describe() == "uniform:10,20"

    for bad in ("0", "uniform:5", "uniform:9,3", "normal:10", "normal:10,2,5,1", "poisson:3", "x", "1.5"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_arrivals_are_poisson_scaled_to_the_rate():
    times = arrival_offsets(4.0, 2000, seed=1)
    assert times == arrival_offsets(4.0, 2000, seed=1)
    assert times != arrival_offsets(4.0, 2000, seed=2)
    assert times[-1] == pytest.approx(2000 / 4.0)             # as vLLM: the last one at count / rate
    gaps = np.diff([0.0, *times])
    assert (gaps >= 0).all()
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)   # exponential: CV 1
    assert arrival_offsets(float("inf"), 5, seed=0) == [0.0] * 5
    unbounded = poisson_arrivals(10.0, seed=0)
    first = [next(unbounded) for _ in range(3000)]
    assert first[-1] == pytest.approx(300, rel=0.06)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tideserve.bench.examples.tiny_llama import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(1024).save_pretrained(path)
    return path


def test_synthetic_prompts_have_the_asked_token_counts(tokenizer_dir):
    tok = Tokenizer(str(tokenizer_dir))
    workload = SyntheticWorkload(tok, LengthDist.parse("uniform:8,300"), LengthDist.parse("normal:20,5"), seed=4)
    requests = [workload.request(0, i) for i in range(60)]
    for r in requests:
        assert r.prompt_len == tok.count(r.prompt)              # what the tokenizer really makes of it
    wanted = [LengthDist.parse("uniform:8,300").sample(np.random.default_rng([4, 1, i, 0])) for i in range(60)]
    assert [r.prompt_len for r in requests] == wanted
    again = SyntheticWorkload(Tokenizer(str(tokenizer_dir)), workload.input_len, workload.output_len, seed=4)
    assert [again.request(0, i).prompt for i in range(60)] == [r.prompt for r in requests]
    other_point = [workload.request(1, i).prompt for i in range(60)]
    warmup = [workload.request(-1, -i).prompt for i in range(1, 61)]
    assert not set(other_point) & {r.prompt for r in requests}   # each point has prompts of its own
    assert not set(warmup) & {r.prompt for r in requests}
    special = set(tok.hf.all_special_ids) | set(tok.hf.added_tokens_decoder)
    assert not special & {t for r in requests for t in tok.encode(r.prompt)}


def test_jsonl_workload_and_saved_workload_round_trip(tmp_path, tokenizer_dir):
    tok = Tokenizer(str(tokenizer_dir))
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "output_tokens": 5}\n\n{"prompt": "Second one"}\n')
    workload = JsonlWorkload(path, tok, LengthDist.parse("9"))
    first, second, third = (workload.request(0, i) for i in range(3))
    assert (first.prompt, first.output_len, first.prompt_len) == ("Hello there", 5, tok.count("Hello there"))
    assert (second.output_len, third.prompt) == (9, "Hello there")   # wraps around
    saved = tmp_path / "saved.jsonl"
    synthetic = SyntheticWorkload(tok, LengthDist.parse("16"), LengthDist.parse("uniform:3,9"), seed=1)
    requests = [synthetic.request(0, i) for i in range(5)]
    save_workload(saved, requests)
    again = JsonlWorkload(saved, tok, LengthDist.parse("1"))
    assert [(r.prompt, r.output_len, r.prompt_len) for r in (again.request(0, i) for i in range(5))] == \
        [(r.prompt, r.output_len, r.prompt_len) for r in requests]
    for bad in ('{"text": "x"}', '{"prompt": "x", "output_tokens": 0}', "not json"):
        (tmp_path / "bad.jsonl").write_text(bad + "\n")
        with pytest.raises(ValueError):
            JsonlWorkload(tmp_path / "bad.jsonl", None, LengthDist.parse("1"))
