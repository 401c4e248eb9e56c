"""`worldserve serve --state-dir` in a subprocess: SIGTERM saves the sessions (one attached, one
detached), a second server restores them, and each resumed session's frames equal those of an
uninterrupted run bit for bit (benchmarks/restart_resume.py runs the same with 16 sessions)."""

from __future__ import annotations

from benchmarks.restart_resume import run


def test_sigterm_then_restart_resumes_every_session_bit_for_bit(tmp_path) -> None:
    figures = run("tiny-random", sessions=2, before=2, after=2, state_dir=tmp_path)
    assert figures["first_exit_status"] == 0 and figures["saved"] == 2
    assert figures["problems"] == [] and figures["bit_identical"] == 2
