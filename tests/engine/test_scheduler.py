"""The scheduler in-process on the real ``tiny`` model: chunked prefill gives the same input
log-probs and tokens as one-shot prefill, and a small ``max_running`` still serves everyone."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from engine.runtime.request import ModelLimits
from engine.runtime.scheduler import FinishEvent, PrefillEvent, Scheduler, TokenEvent
from engine.server.protocol import GenerateReqInput


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Any:
    from engine.model.model import load_model

    return load_model(tiny_dir)


def scheduler(model: Any, **kw: Any) -> Scheduler:
    """A scheduler (not started) of ``model`` at version 0, with no EOS."""
    limits = ModelLimits(model.config.vocab_size, model.config.max_position_embeddings)
    return Scheduler(
        model,
        weight_version=0,
        vocab_size=limits.vocab_size,
        context_len=limits.context_len,
        eos_token_ids=frozenset(),
        **kw,
    )


def run(model: Any, body: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    """Submit ``body`` (a /generate body) to a fresh scheduler; the events of every request."""
    limits = ModelLimits(model.config.vocab_size, model.config.max_position_embeddings)
    specs = GenerateReqInput.model_validate(body).normalize(limits, None)
    sched = scheduler(model, **kw)
    results: list[dict[str, Any]] = [
        {"tokens": [], "prefill": None, "finish": None, "events": []} for _ in specs
    ]
    done = threading.Semaphore(0)

    def sink_for(i: int) -> Any:
        def sink(ev: Any) -> None:
            results[i]["events"].append(ev)
            if isinstance(ev, TokenEvent):
                results[i]["tokens"].append(ev.draw)
            elif isinstance(ev, PrefillEvent):
                results[i]["prefill"] = ev
            elif isinstance(ev, FinishEvent):
                results[i]["finish"] = ev
                done.release()

        return sink

    sched.start()
    try:
        for i, spec in enumerate(specs):
            sched.submit(spec, sink_for(i)).result(10)
        for _ in specs:
            assert done.acquire(timeout=120)
    finally:
        sched.stop()
    results[0]["steps"] = sched.steps
    return results


def test_chunked_prefill_matches_one_shot(model: Any) -> None:
    prompt = [(i * 37) % 250 for i in range(150)]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
    }
    whole = run(model, body, prefill_budget=4096)[0]
    chunked = run(model, body, prefill_budget=16)[0]
    assert chunked["steps"] >= 150 // 16 + 7
    a, b = whole["prefill"], chunked["prefill"]
    assert [t for _, t in a.input_token_logprobs] == prompt == [t for _, t in b.input_token_logprobs]
    assert a.input_token_logprobs[0][0] is None and b.input_token_logprobs[0][0] is None
    assert [lp for lp, _ in b.input_token_logprobs[1:]] == pytest.approx(
        [lp for lp, _ in a.input_token_logprobs[1:]], abs=1e-4
    )
    assert [[t for _, t in top] for top in a.input_top_logprobs[1:]] == [
        [t for _, t in top] for top in b.input_top_logprobs[1:]
    ]
    assert [d.token_id for d in whole["tokens"]] == [d.token_id for d in chunked["tokens"]]


def test_small_running_batch_serves_every_request(model: Any) -> None:
    body = {
        "input_ids": [[65 + i, 66] for i in range(7)],
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
    }
    out = run(model, body, max_running=2)
    assert all(len(r["tokens"]) == 5 for r in out)
    assert all(r["finish"].finish_reason == {"type": "length", "length": 5} for r in out)
    assert out[0]["steps"] >= 4 * 5  # at most two at a time: four rounds of five steps


def test_retract_during_chunked_prefill_recomputes_input_logprobs(model: Any) -> None:
    limits = ModelLimits(model.config.vocab_size, model.config.max_position_embeddings)
    prompt = [(i * 37) % 250 for i in range(150)]
    scoring = {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0},
    }
    reference = run(model, scoring, prefill_budget=4096)[0]["prefill"]
    sched = scheduler(model, prefill_budget=16)
    events: dict[str, list[Any]] = {"score": [], "decode": []}
    retracted = threading.Event()

    def decode_sink(ev: Any) -> None:
        events["decode"].append(ev)
        if isinstance(ev, TokenEvent) and ev.index == 3:  # the long prompt is mid-prefill now
            sched.pause("retract").add_done_callback(lambda _: retracted.set())

    sched.start()
    try:
        decode = GenerateReqInput(
            input_ids=[65, 66], sampling_params={"max_new_tokens": 20, "ignore_eos": True}
        )
        sched.submit(decode.normalize(limits, None)[0], decode_sink).result(10)
        sched.submit(
            GenerateReqInput.model_validate(scoring).normalize(limits, None)[0], events["score"].append
        ).result(10)
        assert retracted.wait(60)
        assert sched.load()["num_queue_reqs"] == 2
        sched.resume().result(10)
        for _ in range(600):
            if all(evs and isinstance(evs[-1], FinishEvent) for evs in events.values()):
                break
            threading.Event().wait(0.05)
    finally:
        sched.stop()
    prefill = [e for e in events["score"] if isinstance(e, PrefillEvent)]
    assert len(prefill) == 1
    got = prefill[0].input_token_logprobs
    assert [t for _, t in got] == prompt
    assert [lp for lp, _ in got[1:]] == pytest.approx(
        [lp for lp, _ in reference.input_token_logprobs[1:]], abs=1e-4
    )
    assert isinstance(events["decode"][-1], FinishEvent) and len(events["decode"]) == 21


def test_the_token_that_finishes_a_request_says_so(model: Any) -> None:
    """Only the last token's event carries ``finishes`` (its finish follows at once: SGLang streams
    the two as one output, scheduler_components/batch_result_processor.py 363-369, 502), and
    nothing comes between them."""
    body = {
        "input_ids": [4, 5],
        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
    }
    events = run(model, body)[0]["events"]
    assert [type(e) for e in events] == [TokenEvent] * 3 + [FinishEvent]
    assert [e.finishes for e in events[:3]] == [False, False, True]


def test_a_to_finish_request_runs_input_0_and_finishes_after_its_first_token(model: Any) -> None:
    """A request SGLang's scheduler aborts with ``set_finish_with_abort`` (here a
    ``logprob_start_len`` past the input, managers/scheduler.py 3275-3279) runs as one prefill of
    ``[0]`` (schedule_batch.py 2233-2236) and finishes with its ``to_finish`` after the first
    token, whatever ``max_new_tokens``, stop ids or EOS say (``update_finish_state`` reads it first,
    schedule_batch.py 2011-2014); no input log-probs are computed."""
    params = {"temperature": 0, "max_new_tokens": 5}
    aborted = {
        "input_ids": [7, 8, 9],
        "return_logprob": True,
        "logprob_start_len": 4,
        "sampling_params": params,
    }
    got = run(model, aborted)[0]
    stub = run(model, {"input_ids": [0], "sampling_params": {**params, "max_new_tokens": 1}})[0]
    assert [d.token_id for d in got["tokens"]] == [d.token_id for d in stub["tokens"]]
    assert got["prefill"].input_token_logprobs == () and got["prefill"].input_top_logprobs == ()
    finish = got["finish"]
    assert finish.finish_reason["type"] == "abort" and finish.finish_reason["status_code"] == 400
    assert "req.logprob_start_len=4 is higher" in finish.finish_reason["message"]
    assert finish.completion_tokens == 1 and got["events"][-2].finishes
    stop = {**params, "stop_token_ids": [stub["tokens"][0].token_id]}  # the drawn id is a stop id
    assert run(model, {**aborted, "sampling_params": stop})[0]["finish"].finish_reason["type"] == "abort"


def test_a_command_cancelled_before_the_scheduler_takes_it_is_not_run(model: Any) -> None:
    """A submit whose future its caller cancelled while it was queued (a client gone before the
    scheduler took its request) is not run, and the scheduler goes on serving: settling a
    cancelled future raises ``InvalidStateError``, which would end the scheduler thread."""
    limits = ModelLimits(model.config.vocab_size, model.config.max_position_embeddings)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    sched = scheduler(model)
    gone: list[Any] = []
    finished = threading.Event()
    cancelled = sched.submit(
        GenerateReqInput.model_validate({**body, "rid": "gone"}).normalize(limits, None)[0], gone.append
    )
    assert cancelled.cancel()  # queued, not yet taken: the scheduler thread is not started
    sched.start()
    try:
        served = GenerateReqInput.model_validate({**body, "rid": "served"}).normalize(limits, None)[0]
        sched.submit(served, lambda ev: finished.set() if isinstance(ev, FinishEvent) else None).result(10)
        assert finished.wait(60) and sched.alive
        assert gone == [] and sched.held(["gone"]) is None
    finally:
        sched.stop()
