"""The bootstrap's progress board: one line per model (steps, loss, ETA), redrawn in place on a terminal,
periodic lines otherwise, and fed across processes by the trainers' throttled reporters."""

from __future__ import annotations

import io

from pivotrl.engines.sft_progress import Board, ModelProgress, reporter


def test_eta_follows_the_rate_since_the_first_report():
    m = ModelProgress("policy", done=10, total=110, loss=0.5)
    assert m.eta_s(5.0) is None  # no rate yet
    m.first = (0.0, 10)
    m.done = 30  # 20 steps in 4 s
    assert abs(m.eta_s(4.0) - 80 / 5) < 1e-9
    line = m.line(4.0)
    assert "policy" in line and "30/110 steps" in line and "loss 0.500" in line and "ETA 0:16" in line


def test_a_terminal_gets_one_line_per_model_redrawn_in_place():
    out = io.StringIO()
    board = Board(["policy", "genrm"], stream=out, tty=True)
    board.update("policy", 1, 4, 1.0)
    board.update("genrm", 1, 2, 2.0)
    board.update("policy", 4, 4, 0.25)
    text = out.getvalue()
    draws = text.split("\x1b[2F")  # every redraw after the first moves up over the two lines
    assert len(draws) == 3
    last = draws[-1].splitlines()
    assert len(last) == 2
    assert "policy" in last[0] and "4/4 steps" in last[0] and "done" in last[0]
    assert "genrm" in last[1] and "1/2 steps" in last[1]


def test_a_log_gets_periodic_lines_and_one_done_line_per_model():
    out = io.StringIO()
    board = Board(["policy", "genrm"], stream=out, tty=False, every_s=3600.0)
    for step in range(1, 6):
        board.update("policy", step, 5, 1.0 / step)
    board.update("genrm", 1, 3, 2.0)
    board.update("genrm", 3, 3, 0.5)
    board.update("genrm", 3, 3, 0.5)  # a repeated final report prints nothing more
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert [line.split()[1] for line in lines] == ["policy", "policy", "genrm", "genrm"]
    assert "1/5" in lines[0] and "5/5" in lines[1] and "done" in lines[1] and "done" in lines[3]


def test_reporter_throttles_but_always_sends_the_last_step():
    sent = []
    report = reporter(sent.append, "genrm", every_s=3600.0)
    for step in range(1, 101):
        report(step, 100, 0.1)
    assert sent == [("genrm", 1, 100, 0.1), ("genrm", 100, 100, 0.1)]
