"""What graphslot logs (the ``graphslot`` logger, quiet by default), when a miscounted
batch is an error rather than an eager step, and progress bars only on a terminal."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch

from graphslot.log import EVERY, LOGGER_NAME, PerReason, get_logger, on_terminal, ordinal, progress_bar
from graphslot.runners import ReplayGuardError
from graphslot.spec.errors import SlotError

import tiny_engine
from tiny_engine import step


@pytest.fixture
def records(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    return caplog


def messages(caplog, logger=None):
    return [r.getMessage() for r in caplog.records if logger is None or r.name == logger]


# ----------------------------------------------------------------------- the logger


def test_the_package_logger_is_quiet_until_an_engine_attaches_a_handler(capfd):
    root = logging.getLogger(LOGGER_NAME)
    assert any(isinstance(h, logging.NullHandler) for h in root.handlers)
    assert get_logger("graphslot.runners.decode").parent.name in ("graphslot.runners", LOGGER_NAME)
    assert get_logger("runners.x").name == "graphslot.runners.x"
    runner = tiny_engine.runner(2, guard=True)
    runner(step(9))  # an eager fallback (INFO)
    runner.adapter.model.scale.data = torch.ones(8)
    with pytest.raises(ReplayGuardError):
        runner(step(2))  # a WARNING: without a handler, still nothing printed (no lastResort)
    assert capfd.readouterr() == ("", "")


def test_an_engine_attaches_its_handler_and_level():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.levelname, record.getMessage()))

    logger = logging.getLogger(LOGGER_NAME)
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        tiny_engine.runner(2)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert {(name, levelname) for name, levelname, _ in seen} == {("graphslot.runners.decode", "INFO")}
    start, _, summary = (message for _, _, message in seen)  # the count, the estimate, the summary
    assert start == "capturing 2 decode graphs (batch sizes 2, 1), backend cpu; static buffers 48 B"
    assert re.fullmatch(r"captured 2 decode graphs \(batch sizes 2, 1\), backend cpu, in \d+\.\d\d s; "
                        r"static buffers 48 B; graph pool \+\d+ B", summary)


# ------------------------------------------------------------------------- capture


def test_a_capture_logs_its_count_estimate_and_summary_and_a_lazy_capture_its_count_and_summary(records):
    tiny_engine.runner(8)
    start, estimate, summary = messages(records)
    assert start == "capturing 4 decode graphs (batch sizes 8, 4, 2, 1), backend cpu; static buffers 192 B"
    assert re.fullmatch(r"decode graphs need about \d+\.\d KiB \(static buffers 192 B \+ \d+\.\d KiB "
                        r"for the first graph x 4\)", estimate)
    assert re.fullmatch(r"captured 4 decode graphs \(batch sizes 8, 4, 2, 1\), backend cpu, in \d+\.\d\d s; "
                        r"static buffers 192 B; graph pool \+\d+\.\d KiB", summary)
    records.clear()
    lazy = tiny_engine.runner(8, lazy=True)
    assert messages(records) == []
    lazy(step(3))
    lazy(step(4))
    start, one = messages(records)  # one key: no estimate
    assert start == "capturing 1 decode graph (batch size 4), backend cpu; static buffers 192 B"
    assert one.startswith("captured 1 decode graph (batch size 4), backend cpu, in ")


# ------------------------------------------------------------------ eager fallbacks


def test_per_reason_logs_the_first_then_every_nth_occurrence(records):
    log = PerReason(get_logger("graphslot.test"), every=3)
    logged = [log.log(reason, "ran eager: %s", reason) for reason in ["a", "a", "b", "a", "a", "a", "a", "b"]]
    assert logged == [True, False, True, True, False, False, True, False]
    assert messages(records) == ["ran eager: a (first time; logged again at the 3rd)",
                                 "ran eager: b (first time; logged again at the 3rd)",
                                 "ran eager: a (3rd time)", "ran eager: a (6th time)"]
    assert log.counts == {"a": 6, "b": 2}
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 111, 1000)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "111th", "1000th"]
    with pytest.raises(ValueError, match="every must be >= 1, got 0"):
        PerReason(get_logger("graphslot.test"), every=0)


def test_each_eager_fallback_reason_is_logged_with_the_step_rate_limited(records):
    runner = tiny_engine.runner(4)
    records.clear()
    assert EVERY == 1000 and runner.eager_log.every == EVERY
    for _ in range(3):
        runner(step(6))
    runner(step(0))
    assert messages(records, "graphslot.runners.decode") == [
        "decode step ran eager: larger than the largest graph (6 rows needed; captured sizes 4, 2, 1) "
        "(first time; logged again at the 1000th)",
        "decode step ran eager: empty batch (first time; logged again at the 1000th)"]
    assert {r.levelname for r in records.records} == {"INFO"}
    assert runner.metrics()["eager_reasons"] == {"larger than the largest graph": 3, "empty batch": 1}


def test_a_replay_guard_failure_is_logged_at_warning(records):
    runner = tiny_engine.runner(2, guard=True)
    runner.adapter.model.head.bias.data = torch.zeros(32)
    with pytest.raises(ReplayGuardError) as info:
        runner(step(1))
    [warning] = [r for r in records.records if r.levelno == logging.WARNING]
    assert warning.name == "graphslot.runners.guard" and warning.getMessage() == str(info.value)
    assert str(info.value).startswith("replay guard: static tensor 'model.head.bias' moved since capture")


# ---------------------------------------------------------------- miscounted batches


def test_a_batch_whose_batch_size_disagrees_with_its_tensors_is_an_error_not_another_forward_mode():
    runner = tiny_engine.runner(4)
    fb = step(3)
    fb.batch_size = 2  # 3 tokens for "2 requests": was eager, "another forward mode"
    with pytest.raises(SlotError) as info:
        runner(fb)
    assert str(info.value) == (
        "spec 'tiny_decode', slot 'seq_lens': Adapter.batch_size says the Step holds 2 request(s), but its field "
        "'seq_lens' (one row per request) has 3 along dim 0 (shape [3]); set the batch's batch_size to its number "
        "of requests (or override batch_size to count them)")
    assert runner.metrics()["eager_fallbacks"] == 0


def test_a_batch_that_is_truly_not_a_decode_step_still_runs_eager_under_that_reason():
    runner = tiny_engine.runner(4)
    fb = step(2)
    fb.input_ids = torch.arange(5)  # 5 tokens for 2 requests whose per-request fields agree: a prefill
    fb.positions = torch.arange(5)
    assert runner.eager_reason(fb) == "not 1 token(s) per request (another forward mode)"


# ------------------------------------------------------------------- progress bars


def test_progress_bars_are_drawn_only_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not on_terminal(True) and not on_terminal(None) and not on_terminal(False)
    tiny_engine.runner(4, progress=True)  # asked for, but stderr is a log: no frames
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert on_terminal(True) and on_terminal(None) and not on_terminal(False)
    tiny_engine.runner(4, progress=True)
    assert "Capturing decode graphs" in capsys.readouterr().err
    tiny_engine.runner(4, progress=False)
    assert capsys.readouterr().err == ""
    assert progress_bar(range(2), show=False).disable


def test_a_closed_stderr_is_no_terminal(monkeypatch):
    def closed():
        raise ValueError("I/O operation on closed file")

    monkeypatch.setattr(sys.stderr, "isatty", closed)
    assert not on_terminal(True)


def test_a_prefill_runners_eager_fallbacks_are_logged_with_their_reason(records):
    from graphslot.reference import make_decode_batch

    from prefill_cases import assert_falls_back_to_eager, make_prefill_runner

    rt, _, runner = make_prefill_runner(capture="breakable", max_bs=4)
    summary = messages(records)[-1]
    assert re.fullmatch(r"captured 3 breakable prefill graphs \(token buckets 64, 32, 16\), backend cpu, in "
                        r"\d+\.\d\d s; static buffers \d+\.\d KiB; graph pool \+\d+\.\d MiB", summary)
    records.clear()
    assert_falls_back_to_eager(rt, runner)
    rpi = rt.req_to_token_pool.alloc(1)
    runner(make_decode_batch(rt, rpi, [3], [1]))
    tail = "(max_bs 4, largest token bucket 64) (first time; logged again at the 1000th)"
    assert messages(records) == [f"breakable prefill ran eager: more tokens than the largest token bucket {tail}",
                                 f"breakable prefill ran eager: more requests than max_bs {tail}",
                                 f"breakable prefill ran eager: not a prefill {tail}"]
