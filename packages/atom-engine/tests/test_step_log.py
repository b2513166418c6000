"""ATOM_STEP_LOG: the engine's per-step log (off unless set)."""

import json

from atom_engine.step_log import ENV_VAR, StepLog


def test_step_log_is_off_unless_set(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert StepLog.from_env() is None
    monkeypatch.setenv(ENV_VAR, "  ")
    assert StepLog.from_env() is None


def test_step_log_appends_one_line_per_step(monkeypatch, tmp_path):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    log = StepLog.from_env()
    log.record(12.5, 0.1014, 0.0991, [1, 1, 128, 1, 16])
    log.record(12.7, 0.05, 0.05, [1])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {
        "start": 12.5,
        "wall_ms": 101.4,
        "cpu_ms": 99.1,
        "decode_rows": 3,
        "prefill_tokens": [128, 16],
    }
    assert lines[1]["decode_rows"] == 1 and lines[1]["prefill_tokens"] == []
