"""`kvtool serve`'s scheduler: requests that join and leave a running batch get exactly what each
gets alone, and admission reserves at least what a request's cache holds."""

from __future__ import annotations

import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.profiles import Draft
from kvtool.serve import Job, Ledger, Scheduler, ServedModel, parse_size
from kvtool.serve import scheduler as scheduler_module
from test_serve_helpers import Run, prompt_ids, tiny_loaded, until_eos
from tiny_models import profile_with

# (prompt words, max_tokens, decode step at which the request arrives): the first two start
# together, the others join a batch already decoding; they leave at different steps. The 4-word
# prompt is too short to compress (kvtool generate runs it through the full cache).
REQUESTS = [(40, 14, 0), (25, 6, 0), (60, 12, 2), (4, 9, 4), (33, 10, 7)]
# Several arrive at once (inside step 1's decode step, so they all wait for the same prompt phase):
# the four compressed ones of different lengths run one batched prompt phase, the two short ones
# (full cache) another; one more joins at step 4, while the batched group decodes.
TOGETHER = [(30, 12, 0), (40, 14, 1), (25, 6, 1), (4, 9, 1), (60, 12, 1), (5, 7, 1), (33, 10, 1), (45, 10, 4)]


def _served(budget: float | None, draft: Draft | None = None) -> ServedModel:
    loaded = tiny_loaded()
    profile = None if budget is None else profile_with(loaded.model, budget, draft=draft)
    return ServedModel(loaded, profile, "test")


def _run_staggered(served: ServedModel, monkeypatch, requests=REQUESTS, prompt_rows: list | None = None,
                   ledger: Ledger | None = None, **job) -> tuple[list[Run], list[int]]:
    """Runs `requests` through one scheduler, each submitted from inside the decode step at which it
    arrives; returns the runs and the batch size of every decode step (`prompt_rows`, if given,
    gets the rows of every prompt phase)."""
    sizes: list[int] = []
    step_of_batch = scheduler_module.decode_step
    if prompt_rows is not None:
        prepared = scheduler_module.prepare

        def counting_prepare(model, prompt, *args, **kwargs):
            prompt_rows.append(prompt.input_ids.shape[0])
            return prepared(model, prompt, *args, **kwargs)

        monkeypatch.setattr(scheduler_module, "prepare", counting_prepare)
    scheduler = Scheduler(served, ledger or Ledger(None, 16))
    runs = [Run(Job(ids=prompt_ids(served.tokenizer, words, seed=i), max_tokens=limit, **job))
            for i, (words, limit, _) in enumerate(requests)]

    def counting(model, caches, tokens, positions):
        sizes.append(len(caches))
        for run, (_, _, arrives) in zip(runs, requests):
            if arrives == len(sizes):
                assert scheduler.submit(run.job)
        return step_of_batch(model, caches, tokens, positions)

    monkeypatch.setattr(scheduler_module, "decode_step", counting)
    try:
        for run, (_, _, arrives) in zip(runs, requests):
            if arrives == 0:
                assert scheduler.submit(run.job)
        for run in runs:
            assert run.done.wait(120), "a request did not finish"
    finally:
        scheduler.stop(30)
    return runs, sizes


def _alone(served: ServedModel, ids: list[int], limit: int) -> list[int]:
    """The request alone through `kvtool generate`'s path (`handle.generate`: draft, compression)."""
    with torch.inference_mode():
        out = served.handle.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=limit, do_sample=False, pad_token_id=0)
    return until_eos(out[0, len(ids):].tolist(), served.eos)


def _check_batch_shape(sizes: list[int]) -> None:
    """Rows joined a running batch and left it: the batch grew, shrank, and grew again."""
    pairs = list(zip(sizes, sizes[1:]))
    first_drop = next(i for i, (a, b) in enumerate(pairs) if b < a)
    assert max(sizes) >= 3 and any(b > a for a, b in pairs[first_drop:]), sizes


def _check_each_alone(served: ServedModel, runs: list[Run]) -> None:
    for run in runs:
        assert run.last[0] == "done", run.last
        assert run.job.generated == _alone(served, run.job.ids, run.job.max_tokens)
        usage = run.last[1]
        assert usage["completion_tokens"] == len(run.job.generated)
        if len(run.job.ids) > served.short_tokens:  # compressed: fewer bytes than the full cache
            assert usage["kv_bytes"] < usage["kv_bytes_full"]
        # Admission reserved at least what the cache came to hold.
        assert served.projected_bytes(len(run.job.ids), run.job.max_tokens) >= usage["kv_bytes"]


@pytest.mark.parametrize("draft", [None, Draft(tokens=6, rounds=2, verify=True)], ids=["no-draft", "draft"])
def test_compressed_requests_joining_and_leaving_equal_each_alone(monkeypatch, draft) -> None:
    served = _served(0.5, draft)
    try:
        runs, sizes = _run_staggered(served, monkeypatch, temperature=0.0)
        _check_batch_shape(sizes)
        _check_each_alone(served, runs)
    finally:
        served.close()


@pytest.mark.parametrize("draft", [None, Draft(tokens=6, rounds=2, verify=True)], ids=["no-draft", "draft"])
def test_requests_arriving_together_share_a_prompt_phase_and_equal_each_alone(monkeypatch, draft) -> None:
    served = _served(0.5, draft)
    try:
        rows: list[int] = []
        runs, sizes = _run_staggered(served, monkeypatch, TOGETHER, prompt_rows=rows, temperature=0.0)
        # The first alone, the four compressed ones as one batch, the two short ones as another, the last alone.
        assert rows == [1, 4, 2, 1], rows
        assert sizes[0] == 1, sizes
        # One of the batched four was still decoding at step 5, the last one's first (it joined at step 4).
        assert max(len(runs[i].job.generated) for i in (1, 2, 4, 6)) >= 5
        _check_each_alone(served, runs)
    finally:
        served.close()


def test_a_request_cancelled_while_waiting_leaves_its_group_to_run(monkeypatch) -> None:
    served = _served(0.5)
    scheduler = Scheduler(served, Ledger(None, 16))
    first = Run(Job(ids=prompt_ids(served.tokenizer, 30, seed=0), max_tokens=6))
    group = [Run(Job(ids=prompt_ids(served.tokenizer, n, seed=i + 1), max_tokens=8)) for i, n in enumerate([40, 25, 50])]
    rows: list[int] = []
    prepared, step_of_batch = scheduler_module.prepare, scheduler_module.decode_step

    def counting_prepare(model, prompt, *args, **kwargs):
        rows.append(prompt.input_ids.shape[0])
        return prepared(model, prompt, *args, **kwargs)

    def arriving(model, caches, tokens, positions):
        if not rows[1:]:  # the first step: the three arrive, and the middle one's client goes away
            for run in group:
                assert scheduler.submit(run.job)
            group[1].job.cancel()
        return step_of_batch(model, caches, tokens, positions)

    monkeypatch.setattr(scheduler_module, "prepare", counting_prepare)
    monkeypatch.setattr(scheduler_module, "decode_step", arriving)
    try:
        assert scheduler.submit(first.job)
        for run in (first, group[0], group[2]):
            assert run.done.wait(60), "a request did not finish"
        scheduler.stop(30)
        assert rows == [1, 2], rows
        assert scheduler.counts["cancelled"] == 1 and scheduler.counts["completed"] == 3
        assert not group[1].events and scheduler.ledger.rows == 0
        for run in (group[0], group[2]):
            assert run.job.generated == _alone(served, run.job.ids, run.job.max_tokens)
    finally:
        served.close()


@pytest.mark.parametrize("together", [False, True], ids=["staggered", "together"])
def test_full_cache_batch_equals_the_unmodified_model(monkeypatch, together) -> None:
    served = _served(None)
    plain = tiny_loaded().model  # the same weights, never attached
    try:
        rows: list[int] = []
        runs, sizes = _run_staggered(served, monkeypatch, TOGETHER if together else REQUESTS, prompt_rows=rows,
                                     temperature=0.0)
        if together:
            assert rows == [1, 6, 1], rows  # without a profile every request runs the full cache: one kind
        else:
            _check_batch_shape(sizes)
        for run in runs:
            ids = torch.tensor([run.job.ids])
            with torch.inference_mode():
                out = plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=run.job.max_tokens,
                                     do_sample=False, pad_token_id=0)
            assert run.job.generated == until_eos(out[0, ids.shape[1]:].tolist(), served.eos)
            assert run.last[1]["kv_bytes_full"] > 0
    finally:
        served.close()


def test_sampled_requests_draw_from_their_own_seed_whatever_the_batch(monkeypatch) -> None:
    served = _served(0.5)
    try:
        runs, _ = _run_staggered(served, monkeypatch, temperature=0.9, top_p=0.8, seed=7)
        again = Run(Job(ids=runs[2].job.ids, max_tokens=runs[2].job.max_tokens, temperature=0.9, top_p=0.8, seed=7))
        scheduler = Scheduler(served, Ledger(None, 4))
        try:
            assert scheduler.submit(again.job) and again.done.wait(60)
        finally:
            scheduler.stop(30)
        assert again.job.generated == runs[2].job.generated
    finally:
        served.close()


def test_stop_sequences_end_the_reply_before_them(monkeypatch) -> None:
    served = _served(0.5)
    try:
        scheduler = Scheduler(served, Ledger(None, 4))
        ids = prompt_ids(served.tokenizer, 30, seed=3)
        first = Run(Job(ids=ids, max_tokens=12))
        assert scheduler.submit(first.job) and first.done.wait(60)
        words = first.text.split()
        assert len(words) >= 4, first.text
        stop = " " + words[2]
        cut = first.text.find(stop)
        second = Run(Job(ids=ids, max_tokens=12, stops=["never there", stop]))
        assert scheduler.submit(second.job) and second.done.wait(60)
        scheduler.stop(30)
        assert second.text == first.text[:cut]
        assert second.last[1]["finish_reason"] == "stop"
        assert first.last[1]["finish_reason"] in ("length", "stop")
    finally:
        served.close()


def test_the_ledger_admits_while_bytes_and_rows_fit() -> None:
    ledger = Ledger(capacity=1000, max_rows=2)
    assert ledger.admit(1, 600)
    assert not ledger.admit(2, 500)  # 1100 bytes > 1000
    assert ledger.admit(3, 400)
    assert not ledger.admit(4, 0)  # no row left
    ledger.release(1)
    assert ledger.reserved == 400 and ledger.rows == 1
    assert Ledger(capacity=None, max_rows=1).admit(1, 10**15)


def test_the_ledger_keeps_room_for_the_prompt_phases_still_to_run() -> None:
    ledger = Ledger(capacity=1000, max_rows=8)
    assert ledger.admit(1, 300, prompt=400)
    assert not ledger.admit(2, 301)  # 300 + 301 + the 400 kept for request 1's prompt phase > 1000
    assert ledger.admit(2, 300)
    assert ledger.room == 400
    ledger.started(1)  # its prompt phase is over: its room goes, its cache's bytes stay
    assert ledger.admit(3, 400) and ledger.reserved == 1000
    assert not ledger.admit(4, 0, prompt=1)
    ledger.release(3)
    assert not ledger.admit(4, 100, prompt=301) and ledger.admit(4, 100, prompt=300)


def test_a_prompt_phase_reserves_the_prompt_it_holds() -> None:
    """Without a draft a compressing layer holds its whole prompt only until it compresses it (one
    layer at a time); a draft holds every layer's, and the draft's rows, until its last round; the full
    cache keeps its prompt as written, which its own reservation already counts."""
    from kvtool.runtime.memory import kv_bytes_per_token

    loaded = tiny_loaded()
    draft = Draft(tokens=6, rounds=2, verify=True)
    per_token = kv_bytes_per_token(loaded.model)
    layers = loaded.model.config.num_hidden_layers
    kinds = {name: ServedModel(loaded, profile_with(loaded.model, 0.2, draft=d), "test") for name, d in (("plain", None), ("draft", draft))}
    full = ServedModel(loaded, None)
    try:
        assert kinds["plain"].prompt_bytes(100, 10) == 100 * per_token // layers
        assert kinds["draft"].prompt_bytes(100, 10) == (100 + 6) * per_token
        assert kinds["draft"].prompt_bytes(100, 3) == (100 + 3) * per_token  # the draft capped by max_tokens
        assert kinds["draft"].compressed_cache.prompt_bytes(3, 100) == 3 * (100 + 6) * per_token
        assert full.prompt_bytes(100, 10) == 0
    finally:
        for served in (*kinds.values(), full):
            served.close()


@pytest.mark.parametrize("draft", [None, Draft(tokens=6, rounds=2, verify=True)], ids=["no-draft", "draft"])
def test_under_tight_memory_prompt_phases_run_as_their_room_allows(monkeypatch, draft) -> None:
    """--kv-memory with room for every cache but one prompt phase at a time: the compressed prompts
    arriving together run one by one (not as one batch of four), every request is answered, and
    each equals what it gets alone."""
    served = _served(0.5, draft)
    try:
        jobs = [(prompt_ids(served.tokenizer, words, seed=i), limit) for i, (words, limit, _) in enumerate(TOGETHER)]
        needs = [served.projected_bytes(len(ids), limit) for ids, limit in jobs]
        prompts = [served.prompt_bytes(len(ids), limit) for ids, limit in jobs]
        ledger = Ledger(sum(needs) + max(prompts), 16)
        shapes: list[tuple[int, int]] = []
        prepared = scheduler_module.prepare

        def checking_prepare(model, prompt, make, chosen_draft, *args, **kwargs):
            if make is not served.full_cache.make:
                rows, width = prompt.input_ids.shape
                shapes.append((rows, width))
                held = served.compressed_cache.footprint.prompt_phase(
                    rows, width + (chosen_draft.tokens if chosen_draft else 0), held=chosen_draft is not None)
                assert ledger.reserved + held <= ledger.capacity, (rows, width)
            return prepared(model, prompt, make, chosen_draft, *args, **kwargs)

        monkeypatch.setattr(scheduler_module, "prepare", checking_prepare)
        runs, _ = _run_staggered(served, monkeypatch, TOGETHER, ledger=ledger, temperature=0.0)
        # Six compressed requests, the four arriving together no longer as one batch (they are with
        # no memory limit: [1, 4, 2, 1] above).
        assert sum(rows for rows, _ in shapes) == 6 and len(shapes) > 3, shapes
        _check_each_alone(served, runs)
    finally:
        served.close()


def test_sizes_read_as_bytes() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512 MiB") == 512 * 1024**2
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("4096") == 4096
    for bad in ("two gigs", "", "5 parsecs", "0"):
        with pytest.raises(KvtoolError, match="kv-memory"):
            parse_size(bad)


def test_a_smaller_budget_admits_more_of_the_same_requests() -> None:
    served = _served(0.2)
    try:
        compressed = served.projected_bytes(200, 20)
        full = served.full_cache.footprint.projected(220)
        assert compressed * 2 < full
    finally:
        served.close()


def test_a_floor_of_entries_and_a_storage_format_serve_what_generate_gives_alone(monkeypatch) -> None:
    """`kvtool serve --min-kept N --kv-format F`: every request equals the handle's own generate
    with that floor and storage, and admission reserves the floor's bytes."""
    loaded = tiny_loaded()
    from kvtool.runtime.precision import KVStorage, at_storage

    profile = at_storage(profile_with(loaded.model, 0.2), KVStorage.parse("int8"), loaded.model, budget=0.1)
    plain = ServedModel(loaded, profile, "test")
    try:
        bare = plain.projected_bytes(60, 10)
    finally:
        plain.close()
    served = ServedModel(loaded, profile, "test", min_kept=40)
    try:
        assert "at least 40 entries per layer" in served.cache_note
        assert served.projected_bytes(60, 10) > bare  # a 60-token prompt keeps 40 entries, not 20% of them
        runs, sizes = _run_staggered(served, monkeypatch, temperature=0.0)
        _check_batch_shape(sizes)
        _check_each_alone(served, runs)
    finally:
        served.close()
